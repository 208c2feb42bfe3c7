"""Single-device attention that a later stage offers to the earlier ones, by registering it here.

The import rule. Imports point down: a stage may import earlier stages and stages/common, and stages/common imports
no stage. Library modules of a stage never import a later stage, not even lazily inside a function. Yet on an sm_90
GPU stage 04's ring blocks and stage 05's GPT should run stage 06's FlashAttention-3 kernels. So stage 06 registers
them when it is imported (one call in stages/06_hopper/__init__.py), and the earlier stages ask this registry which
registered kernels take their problem (find). Programs bring the later stage in: run.py files, train.py's main(),
dev/ scripts, tests and notebooks may `import stages.hopper` to hand its kernels to the registry. A program that does
not gets stages 02/03, and stages 04 and 05 say in their headers which ran. Nothing here imports a stage.

    register(AttentionKernels(name=..., takes=..., forward=..., ..., options=...))   # stage 06, once
    kernels = find(dtype, D, heads=H, kv_heads=Hkv, batch=B, options={"window"})    # stages 04, 05, per problem
"""
from typing import Callable, NamedTuple

# The options an attention call may carry besides causal and scale, by their keyword names in every stage's API
# (stages/common/variants.py). Grouped-query heads are not an option: the heads of q and k, v say it, and takes()
# is asked with both.
OPTIONS = frozenset({"window", "softcap", "alibi_slopes", "dropout_p"})


class AttentionKernels(NamedTuple):
    """What a later stage offers: one device's whole attention, and one ring block added into float32 accumulators.

    takes(dtype, head_dim, *, heads, kv_heads, batch) -> bool   forward and merge_into take q (batch, heads, N,
                                                                head_dim) and k, v of kv_heads heads on this GPU
    forward(q, k, v, *, causal, scale, **options) -> (o, lse)    the whole problem, outputs in q's dtype
    merge_into(q, k, v, o_run, lse_run, rows, keys, *, causal, scale, opts)
                                                                 rows q_start:q_stop against keys k_start:k_stop,
                                                                 O_i, L_i merged into the running float32 (O, L);
                                                                 opts: the block's variants.Options (its window,
                                                                 softcap, ALiBi and origin) or None
    takes_backward(dtype, head_dim, *, heads, kv_heads) -> bool  backward and accumulate_into take this problem
                                                                 (asked after takes)
    backward(q, k, v, o, lse, do, *, causal, scale, **options) -> (dq, dk, dv)
    accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, *, causal, scale, opts)
                                                                 dQ, dK, dV of the block added into the float32
                                                                 accumulators (dk_run, dv_run with kv_heads heads)
    options                                                      the OPTIONS all four take (default none: plain
                                                                 attention, with grouped-query heads where takes
                                                                 says so)
    """
    name: str
    takes: Callable
    forward: Callable
    merge_into: Callable
    takes_backward: Callable
    backward: Callable
    accumulate_into: Callable
    options: frozenset = frozenset()


_REGISTERED = {}  # name -> AttentionKernels, in registration order


def register(kernels):
    """Offer `kernels` (AttentionKernels) to the earlier stages; registering a name again replaces it."""
    if not isinstance(kernels, AttentionKernels):
        raise TypeError(f"register takes an AttentionKernels, got {type(kernels).__name__}")
    unknown = set(kernels.options) - OPTIONS
    if unknown:
        raise ValueError(f"register: options {sorted(unknown)} are not attention options; use some of "
                         f"{sorted(OPTIONS)}")
    _REGISTERED[kernels.name] = kernels._replace(options=frozenset(kernels.options))


def unregister(name):
    """Withdraw the kernels registered under `name` (tests; a program that wants stages 02/03 only)."""
    _REGISTERED.pop(name, None)


def registered():
    """The registered AttentionKernels, in registration order (empty until a later stage is imported)."""
    return tuple(_REGISTERED.values())


def options_in_use(**options):
    """The names of the OPTIONS that are on in these keyword options: a window other than (-1, -1), a softcap or a
    dropout probability other than 0, ALiBi slopes (None is off for each); other keywords (causal, scale, seed,
    origin) are not options."""
    def on(name, value):
        if value is None:
            return False
        if name == "window":
            return tuple(value) != (-1, -1)
        return name == "alibi_slopes" or float(value) != 0

    return frozenset(name for name, value in options.items() if name in OPTIONS and on(name, value))


def find(dtype, head_dim, *, heads, kv_heads, batch, options=(), backward=False):
    """The first registered AttentionKernels that take this problem, or None: every option named (a set of OPTIONS)
    is one of theirs and takes() says yes; with backward=True takes_backward() says yes too."""
    options = frozenset(options)
    for kernels in registered():
        if not options <= kernels.options:
            continue
        if not kernels.takes(dtype, head_dim, heads=heads, kv_heads=kv_heads, batch=batch):
            continue
        if backward and not kernels.takes_backward(dtype, head_dim, heads=heads, kv_heads=kv_heads):
            continue
        return kernels
    return None
