"""Every command the documentation shows runs as shown.

The documentation is every README and notes file (*.md), every notebook, and the docstrings, comments and headers of
the scripts and kernels (*.py, *.sh, *.cu, *.cuh, scripts/mpirun, .ci/run) that git tracks, tests/ aside. A command
is a script of this repository started the way a reader would type it:

    python stages/02_flash_v2/run.py --version fp32        python3 dev/bench.py --quick
    mpirun -n 4 python stages/04_ring/run.py --quick       ./scripts/mpirun -n 4 python stages/04_ring/run.py
    ./scripts/tutorial.sh --full                           ./scripts/test.sh

Checks:
  * the script exists;
  * every option of the command is one of the script's argparse options, spelled out in full, with as many values
    as the option takes, each of its type and among its choices. The options are read from the script's own parser:
    one uninstalled interpreter runs every script in turn with argparse's parsing replaced by a hook that hands the
    parser back (nothing else of a script runs). ./scripts/tutorial.sh's options are run_all.py's; ./scripts/mpirun
    and mpirun's own options come before the Python command that is checked; a script quoted with its options in
    prose (`dev/bench.py --rounds 3`; `run.py --scheme allgather` in a stage's README) is checked as a command;
    ./scripts/test.sh's and ./scripts/lab.sh's options go to pytest and JupyterLab and are not checked. Brackets
    mark optional parts ([--out DIR]: checked as if written out); a value in capitals (D, N, DIR, FILE) or braces
    ({n}) is a placeholder the reader fills in, whose type is not checked.
  * the cheap commands run: each command of the stages' run.py that needs neither mpirun nor a GPU runs in this
    process with --quick and --device cpu added (seconds each), and the README's ring command runs as shown through
    ./scripts/mpirun.
"""
import argparse
import hashlib
import json
import os
import pathlib
import re
import runpy
import shlex
import subprocess
import sys
from typing import NamedTuple

import pytest

from tests.test_entry_scripts import SCRIPTS, UNINSTALLED, _python

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Command(NamedTuple):
    where: str  # file:line (a notebook: file:cell N)
    launcher: tuple  # mpirun or ./scripts/mpirun and its options, or ()
    script: str  # the script's path from the repository root
    args: tuple  # its arguments, as shlex splits them
    text: str  # the command as the documentation shows it


# A Python command, with the mpirun (or ./scripts/mpirun) that starts it, if any, and its options. The arguments end
# where the shell's would (;, |, &&, a comment) or the prose resumes (a backtick, a parenthesis).
PYTHON_COMMAND = re.compile(r"""
    (?P<launcher>(?:(?<![\w/])(?:\./)?scripts/mpirun|\bmpirun|\bmpiexec)(?:\s+(?!python)[^\s`]+)*?\s+)?
    (?P<python>\bpython3?|\$\(command\s+-v\s+python3?\))\s+
    (?P<script>(?:\./)?(?:stages/\w+/\w+\.py|dev/\w+\.py|scripts/\w+\.py))
    (?P<args>[^`#;|&()\n]*)""", re.X)
SHELL_COMMAND = re.compile(r"(?<![\w/.])\./(?P<script>scripts/(?!mpirun\b)[\w.]+)(?P<args>[^`#;|&()\n]*)")
# A script and its options quoted in prose, without the interpreter: `dev/bench.py --rounds 3`, or in a stage's
# README `run.py --scheme allgather` (that stage's run.py).
QUOTED_OPTIONS = re.compile(r"`(?P<script>(?:stages/\w+/\w+\.py|dev/\w+\.py|scripts/\w+\.py)|run\.py|train\.py)"
                            r"(?P<args>\s+-[^`]*)`")
SOURCES = (".md", ".ipynb", ".py", ".sh", ".cu", ".cuh")


def _lines(path):
    """[(where, line)] of a documentation file: a notebook's cells line by line, a shell line continued with a
    backslash joined to the next."""
    rel = str(path.relative_to(ROOT))
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        rows = [(f"{rel}:cell {i}", line) for i, cell in enumerate(json.loads(text)["cells"])
                for line in "".join(cell["source"]).splitlines()]
    else:
        rows = [(f"{rel}:{i + 1}", line) for i, line in enumerate(text.splitlines())]
    joined = []
    for where, line in rows:
        if joined and joined[-1][1].rstrip().endswith("\\"):  # (a docstring's \\ shows as one)
            joined[-1] = (joined[-1][0], joined[-1][1].rstrip().rstrip("\\") + " " + line.strip())
        else:
            joined.append((where, line))
    return joined


def _split(args):
    """shlex tokens of a command's arguments, brackets of optional parts dropped: up to where the sentence goes on
    (", " or ". "), or an unbalanced quote (where a string of the surrounding code ends)."""
    def sentence(text):
        return re.split(r",\s|\.\s|\.$", text.strip())[0].replace("[", " ").replace("]", " ")

    try:
        return tuple(shlex.split(sentence(args)))
    except ValueError:
        return tuple(shlex.split(sentence(re.split(r"[\"']", args)[0])))


def documented_commands():
    """[Command] for every command in the documentation."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = [f for f in files if not f.startswith("tests/") and
             (f.endswith(SOURCES) or f in (".ci/run", "scripts/mpirun"))]
    out = []
    for f in files:
        for where, line in _lines(ROOT / f):
            for m in PYTHON_COMMAND.finditer(line):
                launcher = tuple(shlex.split(m["launcher"] or ""))
                out.append(Command(where, launcher, m["script"].removeprefix("./"), _split(m["args"]),
                                   m[0].strip()))
            for m in SHELL_COMMAND.finditer(line):
                out.append(Command(where, (), m["script"], _split(m["args"]), m[0].strip()))
            for m in QUOTED_OPTIONS.finditer(line):
                script = m["script"]
                if "/" not in script:  # run.py, train.py: the stage's own, in a stage's folder
                    if not re.match(r"stages/\w+/", f):
                        continue
                    script = str(pathlib.PurePosixPath(f).parent / script)
                out.append(Command(where, (), script, _split(m["args"]), m[0].strip("`")))
    return out


COMMANDS = documented_commands()
# ./scripts/X.sh whose arguments go to another program's parser, and the script whose options they are (None: not
# ours to check).
SHELL_OPTIONS = {"scripts/tutorial.sh": "scripts/run_all.py", "scripts/test.sh": None, "scripts/lab.sh": None,
                 "scripts/setup_env.sh": None}


def _checked_script(cmd):
    """The Python script whose parser takes cmd's arguments, or None."""
    return SHELL_OPTIONS.get(cmd.script) if cmd.script.endswith(".sh") else cmd.script


def _expand(script):
    """The scripts a documented path names: itself, or for a placeholder path (stages/NN_name/run.py) every script
    it stands for."""
    if (ROOT / script).exists() or not re.search(r"/[A-Z]+_\w+/", script):
        return [script]
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(re.sub(r"/[A-Z]+_\w+/", "/*/", script)))


BY_SCRIPT = {}
for _cmd in COMMANDS:
    for _script in _expand(_checked_script(_cmd) or ""):
        if _script:
            BY_SCRIPT.setdefault(_script, []).append(_cmd)

# Dead options in files that other work packages are changing, reported to their owners: (file:line, the command as
# shown). The test fails when one of them parses, so the list shrinks as they are fixed.
KNOWN_DEAD = set()

# The child (tests/test_entry_scripts.py's uninstalled interpreter) runs every script in turn, as `python script`
# does, with argparse's parsing replaced by a hook. At a script's first parse the hook checks each documented argument
# list against the script's parser (check_arguments, passed as source) and ends the script with a SystemExit (which
# the ring's error handling lets through): nothing else of the script runs. Between scripts, sys.path is reset and
# every module loaded from the checkout is forgotten (not those of an environment inside it, such as .venv: numpy
# cannot load twice), so each script must find `stages` by itself; the installed packages stay loaded, so the whole
# list costs about one script's imports.
CHILD = UNINSTALLED + """
import argparse, os, runpy
check_source, root, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
exec(check_source)

class Parsed(SystemExit):
    pass

def hand_back(parser, *args, **kwargs):
    raise Parsed(parser)

argparse.ArgumentParser.parse_known_args = hand_back
argparse.ArgumentParser.parse_known_intermixed_args = hand_back
base_path, answers = list(sys.path), {}
for script, docs in jobs:
    sys.argv, sys.path[:] = [script], [os.path.dirname(script)] + base_path  # as `python script` sets them
    try:
        runpy.run_path(script, run_name="__main__")
        answers[script] = {"error": "the script finished without parsing its arguments with argparse"}
    except Parsed as p:
        parser = p.args[0]
        answers[script] = {"usage": parser.format_usage(), "problems": [check_arguments(parser, a) for a in docs]}
    except BaseException as e:
        answers[script] = {"error": f"{type(e).__name__}: {e}"}
    for name, module in list(sys.modules.items()):  # the checkout's modules (not an environment's inside it)
        path = os.path.abspath(getattr(module, "__file__", None) or "/")
        if path.startswith(root + os.sep) and not path.startswith(sys.prefix + os.sep) and "site-packages" not in path:
            del sys.modules[name]
print(json.dumps(answers))
"""


def check_arguments(parser, args):
    """What is wrong with args (a list of strings) for parser: "" when nothing. Every option spelled out in full and
    known to the parser, the right number of values, each converted by the option's type and among its choices;
    positionals only where the parser has some. Placeholders (D, N, DIR, ...) pass any type check."""
    import re as _re

    # D, N, DIR, ..., "$@" (a shell's arguments), {n} (a template's field)
    placeholder = _re.compile(r"^[A-Z][A-Z0-9_]*$|^\.\.\.$|^\$|^\{\w*\}$")
    options = parser._option_string_actions
    positionals = [a for a in parser._actions if not a.option_strings]

    def is_option(token):
        return token.startswith("-") and not _re.match(r"^-\d", token) and token != "-"

    def convert(action, value, name):
        if placeholder.match(value):
            return ""
        try:
            converted = action.type(value) if callable(action.type) else value
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            return f"{name} {value!r}: {e}"
        if action.choices is not None and converted not in action.choices:
            return f"{name} {value!r}: not one of {list(action.choices)}"
        return ""

    i, loose = 0, []  # loose: the positional arguments
    if "--" in args:  # after --, every token is a positional, as argparse reads it
        loose, args = list(args[args.index("--") + 1:]), args[:args.index("--")]
    while i < len(args):
        token = args[i]
        i += 1
        if not is_option(token):
            loose.append(token)
            continue
        name, _, inline = token.partition("=")
        action = options.get(name)
        if action is None:
            return f"{name}: no such option (the script takes {sorted(options)})"
        nargs = action.nargs
        values = [inline] if inline else []
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if nargs == 0 or (nargs is None and action.const is not None and not action.option_strings) or \
                isinstance(action, (argparse._StoreConstAction, argparse._CountAction)) or \
                type(action).__name__ in ("_StoreTrueAction", "_StoreFalseAction", "BooleanOptionalAction"):
            if values:
                return f"{name} takes no value, got {inline!r}"
            continue
        while i < len(args) and not is_option(args[i]) and (
                nargs in ("*", "+", argparse.REMAINDER) or len(values) < (1 if nargs in (None, "?") else nargs)):
            values.append(args[i])
            i += 1
        want = 1 if nargs is None else nargs
        if isinstance(want, int) and len(values) != want:
            return f"{name} takes {want} value(s), got {values}"
        if nargs == "+" and not values:
            return f"{name} takes at least one value"
        for value in values:
            if problem := convert(action, value, name):
                return problem
    loose = [token for token in loose if not placeholder.match(token)]
    if loose and not positionals:
        return f"unexpected arguments {loose} (the script takes no positional argument)"
    for action in positionals:
        for value in loose if action.nargs in ("*", "+", argparse.REMAINDER) else loose[:1]:
            if problem := convert(action, value, action.dest):
                return problem
    return ""


def _check_source():
    import inspect

    return inspect.getsource(check_arguments)


def test_the_documentation_shows_commands():
    """The extraction finds what the READMEs show (a broken pattern would make every other test here vacuous)."""
    shown = {(c.launcher[:1], c.script, c.args) for c in COMMANDS}
    assert ((), "scripts/tutorial.sh", ()) in shown and ((), "scripts/test.sh", ()) in shown
    assert {(("mpirun",), "stages/04_ring/run.py", ("--quick",)),
            (("./scripts/mpirun",), "stages/04_ring/run.py", ("--quick",))} & shown
    bare = PYTHON_COMMAND.search("run `mpirun -n 4 python stages/04_ring/run.py --quick` here")  # a bare mpirun too
    assert bare and bare["launcher"].split() == ["mpirun", "-n", "4"] and bare["args"].split() == ["--quick"]
    assert {s for s in BY_SCRIPT if s.startswith("stages/")} >= {f"stages/{n}/run.py" for n in (
        "00_naive", "01_flash_v1", "02_flash_v2", "03_flash_v2_backward", "04_ring", "05_train_gpt", "06_hopper")}
    assert len(BY_SCRIPT) >= 20


def test_every_documented_script_exists():
    missing = [f"{c.where}: {c.text}" for c in COMMANDS
               if not all((ROOT / s).exists() for s in _expand(c.script)) or not _expand(c.script)]
    assert not missing, "documented commands of scripts that do not exist:\n" + "\n".join(missing)


def test_every_shell_script_shown_is_known():
    """A ./scripts/X.sh command's options are checked against the parser SHELL_OPTIONS names for it."""
    assert {c.script for c in COMMANDS if c.script.endswith(".sh")} <= set(SHELL_OPTIONS)


ALL_SCRIPTS = sorted(set(SCRIPTS) | set(BY_SCRIPT))


@pytest.fixture(scope="session")
def parsed_scripts(tmp_path_factory):
    """{script: the child's answer} for ALL_SCRIPTS, from one child run (once per test process)."""
    jobs = [(str(ROOT / s), [list(c.args) for c in BY_SCRIPT.get(s, [])]) for s in ALL_SCRIPTS]
    out = _python(CHILD, _check_source(), str(ROOT), json.dumps(jobs), cwd=tmp_path_factory.mktemp("elsewhere"),
                  timeout=300)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and lines, f"the uninstalled run of the scripts failed:\n{out.stderr[-3000:]}"
    return {pathlib.Path(k).relative_to(ROOT).as_posix(): v for k, v in json.loads(lines[-1]).items()}


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_runs_without_an_install_and_takes_its_documented_options(script, parsed_scripts):
    """The script reaches its argument parsing from an uninstalled checkout (tests/test_entry_scripts.py), and its
    parser takes every command the documentation shows for it."""
    cmds, result = BY_SCRIPT.get(script, []), parsed_scripts[script]
    assert "error" not in result, f"{script} from an uninstalled checkout: {result['error']}"
    assert "usage" in result["usage"]
    problems = result["problems"]
    dead = [f"{c.where}: {c.text}\n    {why}" for c, why in zip(cmds, problems) if why and (c.where, c.text)
            not in KNOWN_DEAD]
    fixed = [(c.where, c.text) for c, why in zip(cmds, problems) if not why and (c.where, c.text) in KNOWN_DEAD]
    assert not dead, "documented options the script does not take:\n" + "\n".join(dead)
    assert not fixed, f"now parses: remove from KNOWN_DEAD: {fixed}"


def test_the_option_check_fails_on_what_argparse_refuses():
    """check_arguments is not vacuous: an unknown option, a missing value, a bad choice or type, an abbreviation."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", choices=["fp32", "tc"])
    ap.add_argument("--shape", type=int, nargs=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dims", type=int, nargs="+")
    assert check_arguments(ap, ["--version", "tc", "--shape", "1", "2", "3", "--quick", "--dims", "64", "128"]) == ""
    assert check_arguments(ap, ["--shape", "B", "H", "N"]) == ""  # placeholders
    assert "no such option" in check_arguments(ap, ["--sweep"])
    assert "no such option" in check_arguments(ap, ["--vers", "tc"])
    assert "not one of" in check_arguments(ap, ["--version", "fp64"])
    assert "takes 3 value" in check_arguments(ap, ["--shape", "1", "2"])
    assert "invalid literal" in check_arguments(ap, ["--dims", "x"])
    assert "takes no value" in check_arguments(ap, ["--quick=yes"])
    assert "positional" in check_arguments(ap, ["bench.csv"])


# ---------------------------------------------------------------- the cheap commands, run
CHEAP = ("stages/00_naive/run.py", "stages/01_flash_v1/run.py", "stages/02_flash_v2/run.py",
         "stages/03_flash_v2_backward/run.py", "stages/06_hopper/run.py")


def _cheap_runs():
    """{argv: [where]} for each distinct command of a CHEAP script with no launcher, no --help and no --device gpu:
    its arguments with --quick and --device cpu added."""
    runs = {}
    for c in COMMANDS:
        if c.script in CHEAP and not c.launcher and not {"--help", "-h"} & set(c.args) and \
                " ".join(c.args).find("--device gpu") < 0:
            argv = list(c.args) + ["--quick"] * ("--quick" not in c.args) + ["--device", "cpu"] * (
                "--device" not in c.args and c.script != "stages/06_hopper/run.py")
            runs.setdefault((c.script, tuple(argv)), []).append(c.where)
    return runs


CHEAP_RUNS = _cheap_runs()


@pytest.mark.parametrize("script,argv", sorted(CHEAP_RUNS), ids=[" ".join((s.split("/")[1],) + a)
                                                                  for s, a in sorted(CHEAP_RUNS)])
def test_documented_command_runs_on_the_cpu(script, argv, capsys):
    """The command, in this process (the imports are the tests' own: a second each less than a new interpreter)."""
    old = sys.argv
    sys.argv = [str(ROOT / script), *argv]
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = old
    out = capsys.readouterr().out
    assert code in (0, None, True) and re.search(r"^SUMMARY \S+ PASS", out, re.M), \
        f"{script} {' '.join(argv)} (shown at {CHEAP_RUNS[(script, argv)]}) exit {code}:\n{out[-3000:]}"


def test_the_cheap_runs_cover_each_stage():
    assert {s for s, _ in CHEAP_RUNS} == set(CHEAP)


@pytest.mark.mpi
def test_the_readmes_ring_command_runs_through_scripts_mpirun(tmp_path):
    """`./scripts/mpirun -n 4 python stages/04_ring/run.py --quick` from a new shell: PATH without the environment
    (so a bare mpirun would not be found), started from another folder; ATTN_VENV names the environment the tests
    run in, so nothing is installed."""
    shown = [c for c in COMMANDS if c.launcher[:1] == ("./scripts/mpirun",) and c.script == "stages/04_ring/run.py"
             and c.args == ("--quick",)]
    assert shown, "the README shows ./scripts/mpirun -n 4 python stages/04_ring/run.py --quick"
    env = {"HOME": os.environ.get("HOME", str(tmp_path)), "PATH": "/usr/bin:/bin", "ATTN_VENV": sys.prefix}
    stamp = pathlib.Path(sys.prefix, ".requirements.sha")
    if not stamp.exists() or stamp.read_text().strip() != hashlib.sha256((ROOT / "requirements.txt").read_bytes(
            )).hexdigest():  # not the quick start's environment (setup_env.sh would install into it): python3 on PATH
        env.update(PATH=f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin", ATTN_VENV=str(tmp_path / "none"))
    cmd = [str(ROOT / "scripts/mpirun"), *shown[0].launcher[1:], "python", str(ROOT / shown[0].script), "--quick"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "SUMMARY 04_ring PASS" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
