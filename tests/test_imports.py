"""Imports point down: a stage imports only earlier stages and stages/common; stages/common imports no stage; no
module imports itself around a circle (docs/DESIGN.md, "Imports point down").

The test reads every .py file under stages/ with `ast` (nothing is imported, so it takes well under a second) and
collects each import a module makes, at the top or inside a function (a lazy import counts the same):
    import stages.X.Y / import stages.04_ring.Y      from stages import X        from stages.X import Y, Z
    from . import Y / from .Y import Z / from .. import X      (resolved against the module's own package)
    importlib.import_module("stages.X"), __import__("stages.X")
    a helper such as  def _stage(name): return importlib.import_module(f"stages.{name}")  called as
    _stage("hopper.flash_v3"): each call with a string literal is an import of "stages." + the literal
    import train   (a bare name that is a file beside the importer: what a script's own folder on sys.path finds)
Plain names map to the numbered folders by the rule of stages/__init__.py (`NN_name` is `stages.name`, checked
against its STAGES table); `from stages.X import Y` is an import of the module stages.X.Y when Y is a file or folder,
else of the package stages.X (its __init__.py).

It fails on
  - upward: a module of stage N importing a module of stage M > N;
  - common: a module of stages/common importing any stage;
  - circle: modules that import each other around a circle (strongly connected components of the import graph, lazy
    imports included: "no lazy import used to hide one");
  - hidden: an import whose module name is not a literal (`import_module(name)`, a helper called with a variable):
    the test cannot see where it points, so neither can a reader.

Programs. A program is a file of stages/ that is only ever run, never imported by a module:
  - a stage folder's launcher, stages/NN_x/run.py, which no other file of stages/ may import (the test fails if one
    does); and
  - a file with an `if __name__ == "__main__":` block at its top level that no file of stages/ imports, launchers
    aside (stage 05's run.py runs train.py by importing it, which leaves train.py a program if nothing else does).
Everything else is a module, a file with a `__main__` block included once a module imports it (today stage 05's
train.py, which stage 05's __init__.py imports). A program may import a later stage for one reason only: to bring
in the kernels that later stage offers to the earlier ones through stages/common/attention_registry.py (importing the
package registers them). So a program's upward import is allowed only when its target is such a package itself (a
stage whose __init__.py calls `attention_registry.register`, today stage 06: `import stages.hopper`), never one of
its modules.

One named exemption: stages/__init__.py, the finder that maps plain names to folders, imports `f"stages.{name}"` for
whatever name it is asked (HIDDEN_OK).
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HIDDEN_OK = {"stages/__init__.py"}  # the plain-name finder: import_module(f"{__name__}.{name}")
IMPORTERS = {("importlib", "import_module"), (None, "import_module"), (None, "__import__")}


class Module:
    """One file: its dotted name (plain stage names), its stage (an int, "common", or None for stages/__init__.py),
    whether it is a package's __init__.py, whether it is a program, and its parsed tree."""

    def __init__(self, rel, source):
        parts = Path(rel).with_suffix("").parts  # ("stages", "04_ring", "ring")
        self.rel, self.tree = rel, ast.parse(source, rel)
        self.dynamic = "import_module" in source or "__import__" in source  # only then look for dynamic imports
        self.is_package = parts[-1] == "__init__"
        folder = parts[1] if len(parts) > 2 else None
        self.stage = None if folder is None else ("common" if folder == "common" else int(folder[:2]))
        names = ["stages"] + ([plain_name(folder)] if folder else []) + list(parts[2:])
        self.name = ".".join(names[:-1] if self.is_package and len(parts) > 1 else names)
        self.launcher = bool(re.fullmatch(r"stages/\d\d_\w+/run\.py", rel))
        self.main = any(isinstance(n, ast.If) and ast.unparse(n.test).replace("'", '"') == '__name__ == "__main__"'
                        for n in self.tree.body)
        self.program = self.launcher  # load() adds the unimported files with a __main__ block
        self.imports = []  # [(line, target module or None, text)], by load()

    @property
    def package(self):
        return self.name if self.is_package else self.name.rpartition(".")[0]


def plain_name(folder):
    """"04_ring" -> "ring", "common" -> "common" (the rule stages/__init__.py's STAGES table follows)."""
    return folder if folder == "common" else re.fullmatch(r"\d\d_(\w+)", folder).group(1)


def load(files):
    """{name: Module} for {relative path: source}, each with its imports resolved and whether it is a program."""
    modules = {}
    for rel, source in files.items():
        m = Module(rel, source)
        modules[m.name] = m
    for m in modules.values():
        m.imports = imports(modules, m)
    imported = {t for m in modules.values() if not m.launcher for _, t, _ in m.imports if t != m.name}
    for m in modules.values():
        m.program = m.launcher or (m.main and m.name not in imported)
    return modules


def tree_files():
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "stages").rglob("*.py"))}


def _normalise(dotted):
    """stages.04_ring.x -> stages.ring.x."""
    parts = dotted.split(".")
    if len(parts) > 1 and re.fullmatch(r"\d\d_\w+", parts[1]):
        parts[1] = plain_name(parts[1])
    return ".".join(parts)


def _target(modules, dotted, names=()):
    """The modules `from dotted import names` (or `import dotted`) runs: dotted.n where that is a module, else the
    longest prefix of dotted that is one."""
    dotted = _normalise(dotted)
    found = [f"{dotted}.{n}" for n in names if f"{dotted}.{n}" in modules]
    if len(found) < len(names) or not names:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        if dotted:
            found.append(dotted)
    return found


def _importer(call):
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return (f.value.id, f.attr)
    return (None, f.id) if isinstance(f, ast.Name) else None


def _helpers(tree):
    """{function name: (prefix, parameter index)} for functions that import f"{prefix}{parameter}"."""
    helpers = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [a.arg for a in fn.args.args]
        for call in ast.walk(fn):
            if isinstance(call, ast.Call) and _importer(call) in IMPORTERS and call.args:
                arg = call.args[0]
                if (isinstance(arg, ast.JoinedStr) and len(arg.values) == 2
                        and isinstance(arg.values[0], ast.Constant) and isinstance(arg.values[1], ast.FormattedValue)
                        and isinstance(arg.values[1].value, ast.Name) and arg.values[1].value.id in params):
                    helpers[fn.name] = (arg.values[0].value, params.index(arg.values[1].value.id), call)
    return helpers


def imports(modules, m):
    """[(line, target module name or None, text)]: every import of a module of stages/ that m makes; target None is
    an import the test cannot resolve (a name that is not a literal)."""
    found = []
    helpers = _helpers(m.tree) if m.dynamic else {}
    helper_calls = {id(h[2]) for h in helpers.values()}
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "stages" or alias.name.startswith("stages."):
                    found += [(node.lineno, t, f"import {alias.name}") for t in _target(modules, alias.name)]
                elif "." not in alias.name and f"{m.package}.{alias.name}" in modules and m.stage is not None:
                    # a file beside the importer: what a script finds with its own folder first on sys.path
                    found.append((node.lineno, f"{m.package}.{alias.name}", f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = m.package.split(".")
                base = ".".join(base[:len(base) - (node.level - 1)])
                dotted = f"{base}.{node.module}" if node.module else base
            elif node.module and (node.module == "stages" or node.module.startswith("stages.")):
                dotted = node.module
            else:
                continue
            text = f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}"
            found += [(node.lineno, t, text) for t in _target(modules, dotted, [a.name for a in node.names])]
        elif isinstance(node, ast.Call) and m.dynamic:
            who = _importer(node)
            if who in IMPORTERS and node.args and id(node) not in helper_calls:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if arg.value == "stages" or arg.value.startswith("stages."):
                        found += [(node.lineno, t, f"{who[1]}({arg.value!r})") for t in _target(modules, arg.value)]
                elif m.rel not in HIDDEN_OK:
                    found.append((node.lineno, None, f"{who[1]}({ast.unparse(arg)})"))
            elif who and who[0] is None and who[1] in helpers and node.args:
                prefix, i, _ = helpers[who[1]]
                arg = node.args[i] if i < len(node.args) else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    dotted = prefix + arg.value
                    if dotted.startswith("stages"):
                        found += [(node.lineno, t, f"{who[1]}({arg.value!r})") for t in _target(modules, dotted)]
                else:
                    found.append((node.lineno, None, f"{who[1]}({ast.unparse(arg) if arg else ''})"))
    return found


def _registers(m):
    """True if m calls attention_registry.register(...) (a later stage offering its kernels)."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "register"
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "attention_registry"
               for n in ast.walk(m.tree))


def _stage_text(stage):
    return "stages/common" if stage == "common" else f"stage {stage:02d}"


def _cycles(graph):
    """Strongly connected components of more than one module, or one that imports itself (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph.get(v, ()):
                    out.append(sorted(comp))
    return out


def violations(files):
    """Every broken import rule in {relative path: source}, one line each (empty when the tree is clean)."""
    return check(load(files))


def check(modules):
    """violations() of loaded modules {name: Module}."""
    out, graph, edges = [], {name: set() for name in modules}, {}
    for m in modules.values():
        for line, target, text in m.imports:
            where = f"{m.rel}:{line}: {text}"
            if target is None:
                out.append(f"{where}: hidden: the module name is not a literal, so no reader or test sees the import")
                continue
            t = modules[target]
            if target != m.name:
                graph[m.name].add(target)
                edges.setdefault((m.name, target), line)
            if t.launcher and not m.launcher:
                out.append(f"{where}: imports the program {t.rel} (a stage's run.py is run, not imported)")
            if m.stage == "common" and isinstance(t.stage, int):
                out.append(f"{where}: stages/common imports {_stage_text(t.stage)} ({target})")
            elif isinstance(m.stage, int) and isinstance(t.stage, int) and t.stage > m.stage:
                if m.program and t.is_package and _registers(t):
                    continue  # a program brings in the kernels a later stage registers (see the docstring)
                out.append(f"{where}: {_stage_text(m.stage)} imports the later {_stage_text(t.stage)} ({target})")
    for comp in _cycles(graph):
        links = [f"{modules[a].rel}:{edges[a, b]} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        out.append(f"circle: {' <-> '.join(comp)} ({'; '.join(links)})")
    return out


# --- the tree --------------------------------------------------------------------------------------------------------

def test_folder_names_follow_the_finders_table():
    """The plain-name rule this test uses is the one stages/__init__.py maps by."""
    import stages
    folders = {p.name for p in (ROOT / "stages").iterdir() if re.fullmatch(r"\d\d_\w+", p.name)}
    assert {plain_name(f): f for f in folders} == stages.STAGES


@pytest.fixture(scope="module")
def tree():
    """The files of stages/ and their parsed modules, read once for this file's tests."""
    files = tree_files()
    return files, load(files)


def test_imports_point_down(tree):
    found = check(tree[1])
    assert not found, f"{len(found)} import(s) break the rule (docs/DESIGN.md, 'Imports point down'):\n" + "\n".join(
        found)


def test_the_walk_sees_the_imports_it_must(tree):
    """The walk finds imports of every form the tree uses: a test that reads nothing would pass a bad tree."""
    files, modules = tree
    graph = {m.rel: {t for _, t, _ in m.imports} for m in modules.values()}
    assert "stages.common.tolerance" in graph["stages/00_naive/__init__.py"]           # from stages.common import X
    assert "stages.flash_v2.mirror" in graph["stages/02_flash_v2/__init__.py"]         # from . import mirror
    assert "stages.hopper" in graph["stages/04_ring/run.py"]                           # import stages.hopper
    assert "stages.naive" in graph["stages/06_hopper/run.py"]                          # lazy: from stages import naive
    assert len(modules) == len(files) and all(m.launcher == m.rel.endswith("/run.py") for m in modules.values())
    assert modules["stages.train_gpt.train"].main and modules["stages.train_gpt.train"].program


# --- the rule catches what it must (synthetic module sets) ------------------------------------------------------------

BASE = {
    "stages/__init__.py": ("import importlib\ndef __getattr__(name):\n"
                           "    return importlib.import_module(f'{__name__}.{name}')\n"),
    "stages/common/__init__.py": "from .checks import check\n",
    "stages/common/checks.py": "import numpy as np\n",
    "stages/common/attention_registry.py": "def register(k):\n    pass\n",
    "stages/00_naive/__init__.py": "from .naive import forward\nfrom stages.common import checks\n",
    "stages/00_naive/naive.py": "def forward():\n    pass\n",
    "stages/02_flash_v2/__init__.py": "from .flash_v2 import forward\nfrom . import tc\n",
    "stages/02_flash_v2/flash_v2.py": "from stages import naive\nfrom stages.common.checks import check\n",
    "stages/02_flash_v2/tc.py": "import stages.common\n",
    "stages/04_ring/__init__.py": "from .ring import forward\n",
    "stages/04_ring/ring.py": "from stages.flash_v2 import tc\nfrom stages.common import attention_registry\n",
    "stages/04_ring/shards.py": "from stages.naive import forward\n",
    "stages/04_ring/run.py": "import stages.hopper\nfrom stages import ring\n",
    "stages/06_hopper/__init__.py": ("from . import flash_v3\nfrom stages.common import attention_registry\n"
                                     "attention_registry.register(flash_v3.forward)\n"),
    "stages/06_hopper/flash_v3.py": "from stages.flash_v2 import tc\n",
}


def plant(rel, line):
    files = dict(BASE)
    files[rel] = files.get(rel, "") + line + "\n"
    return violations(files)


def test_a_clean_set_passes():
    assert violations(BASE) == []


@pytest.mark.parametrize("rel, line", [
    ("stages/02_flash_v2/tc.py", "from stages import ring"),
    ("stages/02_flash_v2/tc.py", "import stages.ring.ring"),
    ("stages/02_flash_v2/tc.py", "import importlib\nimportlib.import_module('stages.04_ring.ring')"),
    ("stages/02_flash_v2/tc.py", "from stages.ring import forward"),
    ("stages/02_flash_v2/tc.py", "def f():\n    from stages import hopper"),               # lazy
    ("stages/02_flash_v2/tc.py", "def f():\n    import importlib\n    return importlib.import_module('stages.ring')"),
    ("stages/02_flash_v2/tc.py", "def _stage(n):\n    import importlib\n"
                                 "    return importlib.import_module(f'stages.{n}')\n"
                                 "def g():\n    return _stage('hopper.flash_v3')"),
    ("stages/02_flash_v2/tc.py", "__import__('stages.hopper.flash_v3')"),
    ("stages/04_ring/ring.py", "import stages.hopper"),          # a module, not a program: the registry is for run.py
    ("stages/04_ring/run.py", "from stages.hopper import flash_v3"),  # a program may bring in the package only
])
def test_an_upward_import_fails(rel, line):
    found = [f for f in plant(rel, line) if not f.startswith("circle")]  # a planted upward import may close one too
    assert len(found) == 1 and "imports the later stage" in found[0] and found[0].startswith(rel), found


@pytest.mark.parametrize("line", ["from stages import naive", "from stages.naive import forward",
                                  "def f():\n    import stages.flash_v2.tc"])
def test_common_importing_a_stage_fails(line):
    found = [f for f in plant("stages/common/checks.py", line) if not f.startswith("circle")]
    assert len(found) == 1 and "stages/common imports stage 0" in found[0], found


@pytest.mark.parametrize("rel, line, members", [
    ("stages/00_naive/naive.py", "from stages import naive", {"naive", "naive.naive"}),
    ("stages/02_flash_v2/tc.py", "def f():\n    from .flash_v2 import forward\n",         # lazy, relative
     {"flash_v2.flash_v2", "flash_v2.tc"}),
    ("stages/02_flash_v2/flash_v2.py", "from stages.flash_v2 import tc\nfrom stages.flash_v2 import forward",
     {"flash_v2", "flash_v2.flash_v2"}),
])
def test_a_circle_fails(rel, line, members):
    files = dict(BASE)
    files[rel] = files[rel] + line + "\n"
    if rel == "stages/02_flash_v2/tc.py":
        files["stages/02_flash_v2/flash_v2.py"] += "from . import tc\n"
    found = [v for v in violations(files) if v.startswith("circle")]
    assert len(found) == 1 and all(f"stages.{x}" in found[0] for x in members), found


def test_a_hidden_import_fails():
    found = plant("stages/04_ring/ring.py", "def f(name):\n    import importlib\n"
                  "    return importlib.import_module(name)")
    assert len(found) == 1 and "hidden" in found[0], found
    found = plant("stages/04_ring/ring.py", "def _stage(n):\n    import importlib\n"
                  "    return importlib.import_module(f'stages.{n}')\ndef g(x):\n    return _stage(x)")
    assert len(found) == 1 and "hidden" in found[0], found


def test_a_scripts_sibling_is_an_import():
    """`import ring` in stages/04_ring/run.py finds ring.py beside it (a script's folder is first on sys.path)."""
    files = dict(BASE, **{"stages/04_ring/run.py": "import ring\nimport numpy\n"})
    modules = load(files)
    assert [t for _, t, _ in modules["stages.ring.run"].imports] == ["stages.ring.ring"]


def test_a_file_run_as_main_is_a_program_until_a_module_imports_it():
    """A __main__ file nothing imports may bring in the registering package, as run.py may; once a module imports it,
    it is a module and the same line is an upward import."""
    tool = "import stages.hopper\nif __name__ == '__main__':\n    pass\n"
    files = dict(BASE, **{"stages/04_ring/tool.py": tool, "stages/04_ring/run.py": BASE["stages/04_ring/run.py"]
                          + "import tool\n"})
    assert violations(files) == []  # run by run.py: still a program
    files["stages/04_ring/ring.py"] += "from . import tool\n"
    assert any("stages/04_ring/tool.py:1: import stages.hopper: stage 04 imports the later stage 06" in f
               for f in violations(files)), violations(files)


def test_importing_a_program_fails():
    found = plant("stages/04_ring/ring.py", "from . import run")
    assert any("imports the program stages/04_ring/run.py" in f for f in found), found


def test_what_may_pass():
    """Earlier stages, common, the own package, other libraries, a program bringing in the registering package."""
    for line in ("from stages import naive", "import numpy", "from stages.common import checks", "from . import shards",
                 "import cupy", "def f():\n    return __import__('cupy')"):
        assert plant("stages/04_ring/ring.py", line) == [], line
    assert plant("stages/04_ring/run.py", "from stages import hopper") == []
