"""Files small enough to read in one sitting (issue 68's limits, docs/DESIGN.md):

  * no Python file in stages/ over 400 lines, no test file over 500;
  * no function in kernels/ (a __global__ kernel or a __device__ function, in a .cu or .cuh file) over 250 lines,
    counted from the line its declaration starts on (after any `template <...>`) to its closing brace;
  * no __global__ kernel with more than 8 parameters: a kernel takes its arguments as one struct (FwdParams,
    BwdParams, the Hopper kernels' params; kernels/params.cuh), not a list whose positions must match a launcher's.
    Named exception (WIDE_OK): stage 01's two kernels, the FlashAttention v1 lesson in the form of
    flash-attention-minimal, take the paper's arrays by name (Q, K, V, O, l, m, L; the backward's dO, dQ, dK, dV)
    from a launcher of one screen (stages/01_flash_v1/flash_v1.py) that passes them in the same order, with no speed
    layer between. The exception holds their counts exactly: one more parameter fails, and so does one fewer
    (then the entry is stale).

Reading only text, this takes a fraction of a second. The C++ reader blanks comments, string literals and
preprocessor lines (a brace in a comment or a macro counts for nothing), then takes each `{` outside a function
whose text since the previous `;`, `{` or `}` ends in a parameter list `(...)` as a function's body; braces inside a
body (loops, lambdas, initialisers) belong to that function. Synthetic sources below show it finds what it must.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY_LIMIT, TEST_LIMIT, FUNCTION_LIMIT, PARAM_LIMIT = 400, 500, 250, 8
WIDE_OK = {("flash_v1_forward.cu", "flash_v1_forward"): 11, ("flash_v1_backward.cu", "flash_v1_backward"): 13}
KEYWORDS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignof", "static_assert"}


def _lines(path):
    return len(path.read_text().splitlines())


def _blank(source):
    """source with comments, string/char literals and preprocessor lines (with their continuations) turned into
    spaces, line breaks kept."""
    def spaces(m):
        return re.sub(r"[^\n]", " ", m[0])

    source = re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', spaces, source, flags=re.S)
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", spaces, source, flags=re.M)


def _open_paren(code, close):
    """Index of the "(" that the ")" at close closes."""
    depth = 0
    for i in range(close, -1, -1):
        depth += {")": 1, "(": -1}.get(code[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced parentheses")


def _count_params(text):
    depth, count = 0, 0
    for ch in text:
        depth += {"(": 1, "<": 1, "[": 1, ")": -1, ">": -1, "]": -1}.get(ch, 0)
        count += ch == "," and depth == 0
    return count + 1 if text.strip() else 0


def functions(source):
    """[(name, is_global, parameters, first line, last line)] of every function defined in CUDA source text."""
    code = _blank(source)
    out, stack, head_start = [], [], 0  # stack: per open brace, None or (name, global, params, first line)
    for i, ch in enumerate(code):
        if ch == "{":
            entry = None
            if not any(stack):  # not inside a function: is this brace a function's body?
                head = code[head_start:i]
                m = re.search(r"\)\s*(?:const\s*|noexcept\s*|mutable\s*|->\s*[\w:<>\s]+?)*$", head)
                if m:
                    opening = _open_paren(code, head_start + m.start())
                    name = re.findall(r"([A-Za-z_]\w*)\s*$", code[head_start:opening])
                    if name and name[0] not in KEYWORDS:
                        text = head.lstrip()
                        start = head_start + len(head) - len(text)
                        t = re.match(r"template\s*<", text)
                        if t:  # skip the template clause: the declaration starts after it
                            depth, j = 1, t.end()
                            while depth:
                                depth += {"<": 1, ">": -1}.get(text[j], 0)
                                j += 1
                            start += j + len(text[j:]) - len(text[j:].lstrip())
                        entry = (name[0], "__global__" in head, _count_params(code[opening + 1:head_start + m.start()]),
                                 code.count("\n", 0, start) + 1)
            stack.append(entry)
            head_start = i + 1
        elif ch == "}":
            entry = stack.pop() if stack else None
            if entry:
                out.append(entry + (code.count("\n", 0, i) + 1,))
            head_start = i + 1
        elif ch == ";":
            head_start = i + 1
    return out


def kernel_functions():
    """{file name: functions(...)} of every .cu and .cuh file in kernels/."""
    return {p.name: functions(p.read_text()) for p in sorted((ROOT / "kernels").glob("*.cu*"))}


# --- the tree ---------------------------------------------------------------------------------------------------------

def test_python_files_in_stages_read_in_a_sitting():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "stages").rglob("*.py") if (n := _lines(p)) > PY_LIMIT}
    assert not long, f"Python files in stages/ over {PY_LIMIT} lines (split them by idea): {long}"


def test_test_files_read_in_a_sitting():
    long = {p.name: n for p in (ROOT / "tests").glob("*.py") if (n := _lines(p)) > TEST_LIMIT}
    assert not long, f"test files over {TEST_LIMIT} lines (split them by what they test): {long}"


def test_kernel_functions_read_in_a_sitting():
    long = [f"kernels/{f}:{first}: {name} is {last - first + 1} lines"
            for f, fns in kernel_functions().items() for name, _, _, first, last in fns
            if last - first + 1 > FUNCTION_LIMIT]
    assert not long, f"kernel functions over {FUNCTION_LIMIT} lines (the main loop, the epilogue, the scheduler in " \
                     f"functions of their own):\n" + "\n".join(long)


def test_kernels_take_one_struct_not_a_list():
    counts = {(f, name): params for f, fns in kernel_functions().items() for name, is_global, params, _, _ in fns
              if is_global}
    wide = [f"kernels/{f}: {name} takes {n} parameters" for (f, name), n in counts.items()
            if n > PARAM_LIMIT and (f, name) not in WIDE_OK]
    assert not wide, f"__global__ kernels with more than {PARAM_LIMIT} parameters (pass one struct):\n" + \
        "\n".join(wide)
    stale = {key: (n, counts.get(key)) for key, n in WIDE_OK.items() if counts.get(key) != n}
    assert not stale, f"WIDE_OK's counts (wanted, found) are no longer the kernels': {stale}"


def test_every_kernel_is_found():
    """Each __global__ outside comments and macros is a kernel the reader found (a reader that missed some would
    pass them unchecked); every .cu file defines at least one."""
    found = kernel_functions()
    for path in sorted((ROOT / "kernels").glob("*.cu*")):
        expected = len(re.findall(r"\b__global__\b", _blank(path.read_text())))
        assert sum(g for _, g, _, _, _ in found[path.name]) == expected, path.name
        assert path.suffix != ".cu" or expected > 0, path.name
    assert sum(len(fns) for fns in found.values()) > 100  # the __device__ functions too


# --- the reader (synthetic sources) -----------------------------------------------------------------------------------

SOURCE = '''#include "common.cuh"
#define BODY(x) { if (x) { return; } }
// a comment with { braces } and a __global__ void not_a_kernel(int a, int b) {
struct Tile {
  float x[4] = {0, 0, 0, 0};
  __device__ float get(int i) const { return x[i]; }
};
template <int D, typename T>
__device__ __forceinline__ T dot(const T* a, const T* b) {
  T s = 0;
  for (int i = 0; i < D; ++i) { s += a[i] * b[i]; }
  auto f = [&](int j) { return a[j]; };
  return s + f(0);
}
extern "C" {
template <int D>
__global__ void __launch_bounds__(128, 2)
wide(const float* a, float (&b)[D], int c, int d, int e, int f, int g, int h, int i) {
  const char* s = "} {";
  if (c) { BODY(d) }
}
__global__ void narrow(const Params p) { }
}
'''


def test_the_reader_finds_functions_their_lines_and_parameters():
    got = {name: (g, params, first, last) for name, g, params, first, last in functions(SOURCE)}
    assert got == {"get": (False, 1, 6, 6), "dot": (False, 2, 9, 14), "wide": (True, 9, 17, 21),
                   "narrow": (True, 1, 22, 22)}


def test_the_limits_fail_a_long_or_wide_kernel():
    long = "__global__ void k(Params p) {\n" + "  x();\n" * FUNCTION_LIMIT + "}\n"
    (name, _, params, first, last), = functions(long)
    assert last - first + 1 == FUNCTION_LIMIT + 2 > FUNCTION_LIMIT and params == 1
    wide = "__global__ void k(" + ", ".join(f"int a{i}" for i in range(PARAM_LIMIT + 1)) + ") {}"
    assert functions(wide)[0][2] == PARAM_LIMIT + 1 > PARAM_LIMIT
