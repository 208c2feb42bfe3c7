"""Stage 04: run.py's options checked as usage errors, and the settings they resolve to.

Every rank parses the same command line, so every rank finds the same error: each exits with status 2 and rank 0
alone prints one line that names the option and what it takes (argparse's own errors included), before any ring is
built. settings() resolves the defaults that depend on the device and the number of ranks, and says where it changed
what was asked (notes).
"""
import argparse
import sys
from typing import NamedTuple

import numpy as np

from stages import flash_v2, flash_v2_backward
from stages.common import variants

from .compute import flash_version


class Usage(Exception):
    """A bad option: one line, "run.py: error: " + this message, from rank 0; exit status 2 on every rank."""


def usage_exit(message, rank):
    if rank == 0:
        print(f"run.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def world_rank():
    """This process's MPI rank (0 outside mpirun)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


class Parser(argparse.ArgumentParser):
    """argparse whose errors are usage errors as above: one line from rank 0, not the usage block from every rank."""

    def error(self, message):
        usage_exit(message, world_rank())


class Settings(NamedTuple):
    dtype: object  # numpy dtype of the inputs
    D: int
    H: int
    Hkv: int
    n_check: int  # total length of the check
    n_time: int  # total length timed
    opts: dict  # variant options: window, softcap, dropout_p, alibi_slopes
    block: str  # "flash" or "naive"
    versions: tuple  # (stage 02 version, stage 03 version) of the flash blocks, (None, None) for naive ones
    notes: list  # what the run changed from what was asked, in words


def _dims(dims):
    """A set of head dims in words: 'a..b' for a range, else the list."""
    dims = sorted(dims)
    return f"{dims[0]}..{dims[-1]}" if len(dims) > 4 and dims == list(range(dims[0], dims[-1] + 1)) else \
        ", ".join(map(str, dims))


def options_missed(args, gpu, dtype, with_variants):
    """Why the flash blocks cannot take the variant options here, or "" when they can. On the GPU the flash kernels
    take grouped-query k/v, window, softcap, ALiBi and dropout in stage 02 version pipelined only (float16 / bfloat16
    tensor cores, sm_80 or newer); every version's CPU mirror takes them."""
    if not (gpu and with_variants):
        return ""
    vf = flash_version(dtype, args.fwd_version)
    if vf in flash_v2.VARIANT_VERSIONS:
        return ""
    return (f"on the GPU the flash blocks take --kv-heads, --window, --softcap, --alibi and --dropout in stage 02 "
            f"version {' / '.join(flash_v2.VARIANT_VERSIONS)} (float16, or bfloat16 on sm_80 or newer), not {vf} "
            f"({np.dtype(dtype).name})")


def blocks(args, gpu, dtype, with_variants):
    """(block, why): args.block, else flash (stages 02/03) on GPUs and naive (stage 00) on the CPU, and naive on the
    GPU where the flash blocks cannot take the variant options (float32); an explicit --block flash there is an error
    (versions)."""
    why = "" if args.block else options_missed(args, gpu, dtype, with_variants)
    if why:
        return "naive", why
    return args.block or ("flash" if gpu else "naive"), ""


def versions(block, dtype, D, args, gpu=False, with_variants=False):
    """(stage 02 version, stage 03 version) of the flash blocks, checked against dtype, head dim and, on the GPU, the
    variant options; (None, None) for naive blocks. Raises Usage."""
    if block == "naive":
        if args.fwd_version or args.bwd_version:
            raise Usage("--fwd-version/--bwd-version choose stage 02/03 versions; the naive block (stage 00, the CPU "
                        "default) has none: add --block flash")
        return None, None
    picked = []
    for option, given, resolve in (("--fwd-version", args.fwd_version, flash_v2.resolve_version),
                                   ("--bwd-version", args.bwd_version, flash_v2_backward.resolve_version)):
        try:
            picked.append(resolve(given or "auto", dtype))
        except (TypeError, ValueError) as e:
            raise Usage(f"{option} {given or 'auto'} with --dtype {np.dtype(dtype).name}: {e}") from None
    vf, vb = picked
    fwd, bwd = flash_v2.head_dims(vf), flash_v2_backward.HEAD_DIMS[vb]
    if D not in fwd or D not in bwd:
        both = sorted(set(fwd) & set(bwd))
        raise Usage(f"--head-dim {D}: the flash blocks take head dims {_dims(both)} in {np.dtype(dtype).name} "
                    f"(stage 02 {vf}: {_dims(fwd)}; stage 03 {vb}: {_dims(bwd)}), or use --block naive")
    if why := options_missed(args, gpu, dtype, with_variants):
        raise Usage(f"--block flash: {why}. Use --dtype float16 (or bfloat16 on an sm_80+ GPU), or --block naive "
                    "(stage 00 on the same GPU)")
    return vf, vb


def _variant_options(args, H, causal):
    """{window, softcap, dropout_p, alibi_slopes} as given, checked (Usage names the option)."""
    if args.window is not None:
        left, right = args.window
        if left < -1 or right < -1:
            raise Usage(f"--window {left} {right}: LEFT and RIGHT are key counts >= 0 before and after the diagonal, "
                        "or -1 for unbounded")
        if causal and right > 0:
            raise Usage(f"--window {left} {right}: causal attention sees no key after the diagonal, so RIGHT must be "
                        "0 or -1; add --no-causal for a window on both sides")
    if args.softcap is not None and not (np.isfinite(args.softcap) and args.softcap > 0):
        raise Usage(f"--softcap {args.softcap}: takes a finite number > 0 (S -> c tanh(S / c))")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise Usage(f"--dropout {args.dropout}: takes a probability in [0, 1)")
    return {key: val for key, val in (("window", tuple(args.window) if args.window else None),
                                      ("softcap", args.softcap), ("dropout_p", args.dropout),
                                      ("alibi_slopes", variants.alibi_geometric_slopes(H) if args.alibi else None))
            if val is not None}


def settings(args, P, *, gpu, dev, bf16, shared, defaults):
    """The run's Settings from the options, the number of ranks P and the device (dev: "cpu", "gpu" or "gpu_sm75";
    bf16: the GPU computes in bfloat16; shared: several ranks share a device; defaults: run.py's configuration).
    Raises Usage."""
    notes = []
    dtype = defaults["dtypes"][args.dtype or {"gpu": "bfloat16", "gpu_sm75": "float16", "cpu": "float32"}[dev]]
    if gpu and not bf16 and np.dtype(dtype).name == "bfloat16":
        raise Usage("--dtype bfloat16: this GPU has no bfloat16 tensor cores (sm_75); use --dtype float16 or float32")
    D = args.head_dim if args.head_dim is not None else defaults["head_dim"][dev]
    H = args.heads if args.heads is not None else (2 if args.quick else defaults["heads"][dev])
    if args.scheme == "alltoall" and args.heads is None and args.kv_heads is None and H % P:
        notes.append(f"H = {P * -(-H // P)}, not the default {H}: the all-to-all gives each of the {P} ranks whole "
                     "heads (pass --heads to choose)")
        H = P * -(-H // P)
    Hkv = args.kv_heads or H
    if H % Hkv:
        raise Usage(f"--kv-heads {Hkv}: must divide --heads {H} (grouped-query attention: each k, v head serves "
                    "H / Hkv query heads)")
    if args.scheme == "alltoall" and (H % P or Hkv % P):
        raise Usage(f"--scheme alltoall gives each of the {P} ranks H/P query heads and Hkv/P kv heads: {P} ranks "
                    f"must divide --heads {H} and --kv-heads {Hkv} (use --scheme ring or allgather, or other head "
                    "counts)")
    if args.scheme == "alltoall" and args.dropout:
        raise Usage("--scheme alltoall with --dropout: each rank's heads are a problem of their own, so the dropout "
                    "mask would not be one device's; use --scheme ring or allgather")
    causal = not args.no_causal
    opts = _variant_options(args, H, causal)
    with_variants = bool(opts) or Hkv != H
    block, why = blocks(args, gpu, dtype, with_variants)
    if why:
        notes.append(f"blocks naive: {why}")
    vers = versions(block, dtype, D, args, gpu, with_variants)
    n_check = args.check_seq if args.check_seq is not None else (256 if args.quick else defaults["check_seq"])
    per_rank = ((1024 if gpu else 64) if args.quick else
                defaults["tokens"]["cpu" if not gpu else "shared" if shared else dev])
    n_time = args.seq if args.seq is not None else P * per_rank
    if args.dropout and block == "flash" and gpu:
        grid = 16 * P if args.layout == "contiguous" else 32 * P  # whole 16-row tiles in every shard chunk
        for option, n in (("--check-seq", n_check), ("--seq", n_time)):
            if n % grid:
                raise Usage(f"{option} {n}: with --dropout the GPU kernels draw the mask in 16 x 16 tiles of the "
                            f"whole problem, so {P} ranks, layout {args.layout}, take a multiple of {grid}")
    return Settings(dtype, D, H, Hkv, n_check, n_time, opts, block, vers, notes)
