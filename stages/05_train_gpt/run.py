"""Stage 05: train a small GPT with our attention; the tutorial's last step.

    python stages/05_train_gpt/run.py --quick     # the tiny config on the CPU: the loss must clearly fall
    python stages/05_train_gpt/run.py             # the default config (--attention, --steps, ...: see train.py)
    python stages/05_train_gpt/run.py --help

This is train.py under the name every stage's runner has (scripts/run_all.py runs `run.py --quick`): the
same arguments, the same log, ending in `SUMMARY 05_train_gpt PASS|FAIL ...`. --quick runs on the CPU
(numpy, float32) unless --device says otherwise, so that it takes the same short time everywhere.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train  # noqa: E402  (train.py, next to this file: it sets the BLAS threads before numpy loads)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--quick" in argv and not any(a.startswith("--device") for a in argv):
        argv += ["--device", "cpu"]
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
