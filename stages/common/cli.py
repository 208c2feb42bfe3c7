"""Command-line helpers shared by every run.py and script: argparse types that reject what a stage cannot
run, with a message naming the option (argparse adds it) and what is allowed.

    ap.add_argument("--seq", type=positive_int, default=SEQ)
    ap.add_argument("--repeat", type=positive_int, default=3)
    check_head_dim(ap, "--head-dim", D, flash_v2.head_dims(version), f"version {version}")
"""
import argparse


def positive_int(text):
    """An int >= 1 (sizes, lengths, repeats)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def nonnegative_int(text):
    """An int >= 0 (warm-up counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


def check_head_dim(ap, option, D, supported, what):
    """ap.error unless D is in supported (a container of ints, or None for any 1..128)."""
    if supported is None:
        if not 1 <= D <= 128:
            ap.error(f"{option} {D}: {what} takes head dims 1..128")
    elif D not in supported:
        ap.error(f"{option} {D}: {what} takes head dims {', '.join(str(d) for d in sorted(supported))}")
