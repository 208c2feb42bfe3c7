"""Stage 05: train a small GPT from scratch with our attention (numpy on the CPU, CuPy on a GPU).

    python stages/05_train_gpt/train.py                              # associative recall, naive attention
    python stages/05_train_gpt/train.py --attention flash_v2         # the same run through stages 02 + 03
    python stages/05_train_gpt/train.py --quick                      # tiny config on the CPU: the loss must fall
    python stages/05_train_gpt/train.py --data README.md --steps 500 # any text file, character level
    python stages/05_train_gpt/train.py --device gpu --context 4096 --layers 6 --d-model 384 --heads 6 \\
        --batch 1 --steps 50 --attention flash_v2                    # long context on a GPU, bfloat16 activations
    python stages/05_train_gpt/train.py --heads 4 --kv-heads 2 --d-model 256   # grouped-query heads (Llama's GQA)
    ./scripts/mpirun -n 4 python stages/05_train_gpt/train.py --attention ring   # sequence parallel through the ring
    python stages/05_train_gpt/train.py --attention ring --simulate-ranks 4     # the same, ranks as threads

The options and the run are command.py's; this file is the program. A program, not the model, brings in stage 06:
importing it registers its FlashAttention-3 kernels (stages/common/attention_registry.py), which flash_v2 attention
and the ring's flash blocks then run on an sm_90 GPU. Stage 05's modules never import that later stage themselves
(imports point down).
"""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before numpy loads its BLAS:
    os.environ.setdefault(_var, "1")  # the CPU configs' matrices are too small for BLAS threads to pay

import stages.hopper  # noqa: E402, F401  (stage 06's kernels into the registry: used on an sm_90 GPU)
from stages.train_gpt.command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
