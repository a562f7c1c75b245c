"""argparse types that check a number flag's range in the parent, before any rank starts:
argparse then exits with code 2 and names the flag (``argument --alpha: must be ...``)."""

import argparse
import math
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"int >= {minimum}"  # argparse's fallback wording
    return parse


def float_above(minimum: float, *, inclusive: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite float > ``minimum`` (>= with ``inclusive``)."""
    rule = f"{'>=' if inclusive else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"must be a finite number {rule}, got {text!r}")
        return value

    parse.__name__ = f"number {rule}"
    return parse


def cpu_share(text: str) -> float:
    """An argparse ``type``: a share of the CPU in [0, 1) (``--busy``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a share of the CPU in [0, 1), got {text!r}")
    return value


BUSY_HELP = (
    "take SHARE (0 <= SHARE < 1) of every core from the ranks: one busy process per core, pinned to it, spins "
    "SHARE of every 10 ms (a busier machine, measured: docs/measuring.md#a-busier-machine; default 0)"
)
