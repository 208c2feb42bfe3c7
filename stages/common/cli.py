"""Command-line helpers shared by every run.py and script: argparse types that reject what a stage cannot
run, with a message naming the option (argparse adds it) and what is allowed.

    ap.add_argument("--seq", type=positive_int, default=SEQ)
    ap.add_argument("--repeat", type=positive_int, default=3)
    check_head_dim(ap, "--head-dim", D, flash_v2.head_dims(version), f"version {version}")
"""
import argparse


def _int_at_least(minimum, what):
    """An argparse type: an int >= minimum, else an error naming what is allowed."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    parse.__doc__ = f"An int >= {minimum}."
    return parse


positive_int = _int_at_least(1, "positive_int")  # sizes, lengths, repeats
nonnegative_int = _int_at_least(0, "nonnegative_int")  # warm-up counts


def check_head_dim(ap, option, D, supported, what):
    """ap.error unless D is in supported (a container of ints, or None for any 1..128)."""
    if supported is None:
        if not 1 <= D <= 128:
            ap.error(f"{option} {D}: {what} takes head dims 1..128")
    elif D not in supported:
        ap.error(f"{option} {D}: {what} takes head dims {', '.join(str(d) for d in sorted(supported))}")
