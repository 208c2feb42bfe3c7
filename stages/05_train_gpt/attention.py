"""Stage 05: the attention kernel inside the GPT is any stage: `--attention naive | flash_v1 | flash_v2 | ring`.

Each kernel object has the stage API restricted to what a decoder needs (causal, scale 1/sqrt(D)):
    o, lse = attn.forward(q, k, v)                    q, o: (B, H, N, D); k, v: (B, Hkv, N, D); lse: (B, H, N)
    dq, dk, dv = attn.backward(q, k, v, o, lse, do)   dk, dv: (B, Hkv, N, D), summed over each group of query heads
A stage that does not take the model's compute dtype gets its inputs cast to one it takes (flash_v1 only
takes float32: bfloat16 activations are widened for it, and its results rounded back). A stage that does not take
grouped-query k, v (Hkv < H: flash_v1; flash_v2's float32 versions on a GPU) gets each k / v head repeated for the
H / Hkv query heads that read it, and the gradients of the copies summed back into their head (repeat_kv,
sum_groups): the same maths as a kernel that reads the shared head, which naive, the 16-bit flash_v2 and the ring do.

flash_v2 in 16 bits runs a later stage's kernels where one registered kernels that take the problem
(stages/common/attention_registry.py): on an sm_90 GPU (H100, H200) stage 06's forward and backward
(FlashAttention-3), grouped-query heads included, once a program has imported `stages.hopper` (train.py's main
does). This stage never imports stage 06 itself: imports point down. The ring computes each (query shard, key block)
pair with stage 00 ("naive" blocks) or stages 02/03 ("flash" blocks; on an sm_90 GPU stage 04 runs stage 06's blocks
where they take the problem, hopper_ring_text); ring_blocks() decides which, from the head dim, the dtype, the heads
and the device (passed in as arguments, so the decision is tested without a GPU).
"""
import numpy as np

from stages import flash_v1, flash_v2, flash_v2_backward, naive
from stages import ring as ring_stage  # stage 04 (`ring` names the communicator below)
from stages.common import array_module, attention_registry, bfloat16, cast

ATTENTIONS = ("naive", "flash_v1", "flash_v2", "ring")


STAGES = {"naive": naive, "flash_v1": flash_v1, "flash_v2": flash_v2, "flash_v2_backward": flash_v2_backward,
          "ring": ring_stage}  # the earlier stages this one runs as its attention


def repeat_kv(x, group):
    """(B, Hkv, N, D) -> (B, Hkv group, N, D): k / v head j repeated for query heads j group .. (j + 1) group - 1,
    the heads that read it (grouped-query attention as a kernel without it computes it)."""
    return array_module(x).repeat(x, group, axis=1)


def sum_groups(dx, group):
    """(B, H, N, D) -> (B, H / group, N, D): the gradient of a k / v head is the sum of the gradients of its copies,
    since each query head of its group read it (the backward of repeat_kv)."""
    B, H, N, D = dx.shape
    return dx.reshape(B, H // group, group, N, D).sum(axis=2)  # (B, Hkv, group, N, D) summed over the group


class StageAttention:
    """Causal attention by one single-device stage (00 naive, 01 flash_v1, 02 + 03 flash_v2), for q of `heads` heads
    and k, v of `kv_heads` (None: heads), at up to `batch` sequences a call."""

    def __init__(self, name, head_dim, dtype, *, heads=1, kv_heads=None, batch=1):
        dtype = np.dtype(dtype)
        if name not in ATTENTIONS or name == "ring":
            raise ValueError(f"attention {name!r} is not a single-device stage; use one of "
                             f"{[a for a in ATTENTIONS if a != 'ring']} (ring: see RingAttention)")
        kv_heads = kv_heads or heads
        if heads % kv_heads:
            raise ValueError(f"attention {name}: {kv_heads} k, v heads do not divide {heads} query heads "
                             "(grouped-query attention: each k, v head serves heads / kv_heads query heads)")
        self.name, self.dtype = name, dtype
        self.kernel_dtype = dtype
        if name == "flash_v1":
            if dtype == np.float64:
                raise TypeError("attention flash_v1 takes float32 (and bfloat16, widened to float32), not float64; "
                                "the float64 finite-difference checks use attention naive")
            self.kernel_dtype = np.dtype(np.float32)
            if not 1 <= head_dim <= 128:
                raise ValueError(f"attention flash_v1: head dim {head_dim} is not supported (1..128); "
                                 "change d_model / n_heads")
        elif name == "flash_v2":
            if dtype == np.float64:
                raise TypeError("attention flash_v2 takes float32 or bfloat16, not float64; "
                                "the float64 finite-difference checks use attention naive")
            bwd = flash_v2_backward
            version = "fp32" if dtype == np.float32 else "tc"
            dims = sorted(set(bwd.HEAD_DIMS[version]) & set(flash_v2.head_dims(
                "fp32" if dtype == np.float32 else "pipelined")))
            if head_dim not in dims:
                raise ValueError(f"attention flash_v2 in {dtype.name}: head dim {head_dim} is not supported by "
                                 f"stages 02 + 03; use one of {dims} (head dim = d_model / n_heads)")
        # grouped-query k, v: naive takes them, and so do stages 02/03 in 16 bits (every version's mirror too, but
        # not their float32 kernels on a GPU, so float32 repeats them everywhere: the same run on the CPU and GPU)
        self.group = heads // kv_heads
        self.repeat = self.group > 1 and (name == "flash_v1" or (name == "flash_v2" and dtype == np.float32))
        self.mod = STAGES[name]
        self.fwd, self.bwd = self.mod.forward, self.mod.backward
        if name == "flash_v2":  # stage 02 is the forward; its backward is stage 03
            self.bwd = flash_v2_backward.backward
        self.kernels = None  # what runs instead of the stage named, for the run's header
        if name == "flash_v2":  # a later stage's kernels where registered ones take the problem (never float32)
            shape = dict(heads=heads, kv_heads=kv_heads, batch=batch)
            fwd = attention_registry.find(self.kernel_dtype, head_dim, **shape)
            bwd = attention_registry.find(self.kernel_dtype, head_dim, backward=True, **shape)
            self.fwd = fwd.forward if fwd is not None else self.fwd
            self.bwd = bwd.backward if bwd is not None else self.bwd
            ran = {}  # the registered kernels' name -> what they compute
            for kernels, what in ((fwd, "forward"), (bwd, "backward")):
                if kernels is not None:
                    ran.setdefault(kernels.name, []).append(what)
            self.kernels = "; ".join(f"{name}: {' and '.join(whats)}" for name, whats in ran.items()) or None

    def forward(self, q, k, v):
        kd = self.kernel_dtype
        k, v = (repeat_kv(t, self.group) if self.repeat else t for t in (k, v))  # (B, H, N, D) if repeated
        o, lse = self.fwd(cast(q, kd), cast(k, kd), cast(v, kd), causal=True)
        return cast(o, self.dtype), lse

    def backward(self, q, k, v, o, lse, do):
        kd = self.kernel_dtype
        k, v = (repeat_kv(t, self.group) if self.repeat else t for t in (k, v))
        dq, dk, dv = self.bwd(*(cast(t, kd) for t in (q, k, v, o)), lse, cast(do, kd), causal=True)
        if self.repeat:  # each k / v head's copies were read by the query heads of its group: their sum
            dk, dv = sum_groups(dk, self.group), sum_groups(dv, self.group)  # (B, Hkv, N, D)
        return tuple(cast(g, self.dtype) for g in (dq, dk, dv))


class RingAttention:
    """Causal attention over the whole sequence when this rank holds only a shard of it (stage 04).

    q, k, v are this rank's rows (global positions ring.positions(rank, P, n, layout)); the K/V shards of
    the other ranks come around the ring. block: how each (query shard, key block) pair is computed,
    "naive" (stage 00, the CPU default) or "flash" (stages 02/03, the GPU default)."""

    def __init__(self, ring, n_global, layout, block, dtype):
        R = ring_stage
        if layout not in R.LAYOUTS:
            raise ValueError(f"ring layout {layout!r} is not known; use one of {R.LAYOUTS}")
        if block not in ("naive", "flash"):
            raise ValueError(f"ring block {block!r} is not known; use naive or flash")
        self.R, self.ring, self.n, self.layout, self.block = R, ring, n_global, layout, block
        self.dtype = np.dtype(dtype)

    def forward(self, q, k, v):
        o, lse = self.R.ring_forward(q, k, v, ring=self.ring, nq=self.n, nk=self.n, causal=True,
                                     layout=self.layout, block=self.block)
        return cast(o, self.dtype), lse

    def backward(self, q, k, v, o, lse, do):
        return self.R.ring_backward(q, k, v, o, lse, do, ring=self.ring, nq=self.n, nk=self.n, causal=True,
                                    layout=self.layout, block=self.block)


def _dims(dims):
    """Head dims as a reader writes them: '64, 128, 256', or '1..128' for a long run."""
    dims = sorted(dims)
    return f"{dims[0]}..{dims[-1]}" if len(dims) > 4 else ", ".join(map(str, dims))


def _flash_versions(dtype, head_dim=None, tf32=False):
    """(stage 02 version, stage 03 version) the flash blocks run for dtype (each stage's "auto"); TypeError if none.
    tf32: on a GPU with TF32 tensor cores (sm_80 and newer), where "auto" runs float32 in version fp32x3 at the head
    dims it takes."""
    dtype = np.dtype(dtype)
    fwd, bwd = flash_v2, flash_v2_backward
    vf, vb = fwd.resolve_version("auto", dtype), bwd.resolve_version("auto", dtype)
    if tf32 and vf == "fp32_overlap" and head_dim in fwd.head_dims("fp32x3"):
        vf = "fp32x3"
    if tf32 and vb == "fp32" and head_dim in bwd.HEAD_DIMS["fp32x3"]:
        vb = "fp32x3"
    return vf, vb


def flash_blocks_missing(dtype, head_dim, *, gpu, sm80=True, grouped=False):
    """Why the ring's flash blocks (stage 02 forward, stage 03 backward, the versions their "auto" picks for dtype)
    cannot run here, or "" when they can. gpu: the arrays are CuPy arrays; sm80: that GPU has bfloat16 tensor cores
    (sm_80 or newer, stages.common.device: Arch.bf16; a T4's kernels take float16); grouped: k, v have fewer heads
    than q, which the GPU kernels take in stage 02's VARIANT_VERSIONS only (16 bits). On the CPU the stages' tile
    mirrors run, with the same dtypes and head dims as the kernels, and every variant."""
    dtype = np.dtype(dtype)
    try:
        vf, vb = _flash_versions(dtype)
    except TypeError:
        return f"dtype {dtype.name} is not taken by stages 02/03 (float32, float16, bfloat16)"
    for stage, version, dims in (("02", vf, flash_v2.head_dims(vf)),
                                 ("03", vb, flash_v2_backward.HEAD_DIMS[vb])):
        if head_dim not in dims:
            return f"head dim {head_dim} is not taken by stage {stage} version {version}, which takes {_dims(dims)}"
    if gpu and dtype == bfloat16 and not sm80:
        return (f"stage 02 version {vf} and stage 03 version {vb} in bfloat16 need an sm_80 or newer GPU (this one "
                "takes float16)")
    variant_versions = flash_v2.VARIANT_VERSIONS
    if gpu and grouped and vf not in variant_versions:
        return (f"grouped-query k, v (--kv-heads) run on the GPU in stage 02 version {' / '.join(variant_versions)} "
                f"(float16 / bfloat16), not {vf} ({dtype.name})")
    return ""


def ring_blocks(requested, *, dtype, head_dim, gpu, sm80=True, grouped=False):
    """(block, description) for the ring inside the GPT: "flash" or "naive", and a phrase for the run's header.

    requested None chooses: flash (stages 02/03) on a GPU where they take head_dim, dtype and grouped-query heads
    (grouped: fewer k, v heads than query heads), naive (stage 00)
    otherwise, and on the CPU (where the stages' tile mirrors would be exact but slow); the description says why.
    An explicit "flash" that cannot run here is a ValueError that says what to change; "naive" always runs."""
    if requested not in (None, "naive", "flash"):
        raise ValueError(f"ring block {requested!r} is not known; use naive or flash")
    why = flash_blocks_missing(dtype, head_dim, gpu=gpu, sm80=sm80, grouped=grouped)
    if requested == "flash" and why:
        fix = ""
        if why.startswith("head dim"):  # the head dims both stages take in this dtype
            vf, vb = _flash_versions(dtype)
            both = set(flash_v2.head_dims(vf)) & set(flash_v2_backward.HEAD_DIMS[vb])
            fix = f", or a head dim (d_model / heads) of {_dims(both)}"
        elif why.startswith("grouped"):
            fix = ", or --dtype bfloat16 (float16 on a GPU older than sm_80)"
        raise ValueError(f"--ring-block flash cannot run here: {why}; use --ring-block naive (stage 00){fix}")
    if requested == "naive":
        return "naive", "naive (stage 00, as asked)"
    if requested is None and not gpu:
        return "naive", "naive (stage 00, the CPU default: the stage 02/03 tile mirrors are exact but slow)"
    if why:
        return "naive", f"naive (stage 00): {why}"
    vf, vb = _flash_versions(dtype, head_dim, tf32=sm80)
    return "flash", f"flash (stage 02 version {vf}, stage 03 version {vb})"


def hopper_ring_text(block, dtype, head_dim, *, heads, batch, gpu, kv_heads=None):
    """The phrase a run's header adds to ring_blocks' description when stage 04 runs stage 06's blocks in place of
    the flash blocks: block "flash", on the GPU (gpu: the arrays are CuPy arrays), for a problem stage 06 takes there,
    k, v of kv_heads heads (None: heads) included (stage 04: hopper_takes, hopper_backward_takes); else ""."""
    if block != "flash" or not gpu:
        return ""
    R = ring_stage
    shape = dict(H=heads, Hkv=kv_heads or heads, B=batch)
    if not R.hopper_takes(dtype, head_dim, **shape):
        return ""
    which = "forward and backward" if R.hopper_backward_takes(dtype, head_dim, **shape) else "forward"
    return f"; on this sm_90 GPU stage 04 runs stage 06's {which} blocks (FlashAttention-3) in their place"


def make_attention(name, head_dim, dtype, *, heads=1, kv_heads=None, batch=1):
    """The single-device kernel object for --attention `name` (ring: build RingAttention with a communicator), for
    q of `heads` heads and k, v of `kv_heads` (None: heads), up to `batch` sequences a call."""
    if name not in ATTENTIONS:
        raise ValueError(f"--attention {name!r} is not known; choose one of {ATTENTIONS}")
    return StageAttention(name, head_dim, dtype, heads=heads, kv_heads=kv_heads, batch=batch)


__all__ = ["ATTENTIONS", "StageAttention", "RingAttention", "make_attention", "ring_blocks", "hopper_ring_text",
           "flash_blocks_missing", "repeat_kv", "sum_groups"]
