"""The bounds a client's numbers are checked against, once, wherever they enter.

qmc-serve's fields, the plugin's ``vllm_xargs`` / ``extra_args``, ``GroupSpec`` and the
transformers API all refuse a value outside these with a ``ValueError`` naming the field
and the allowed range, so nothing past the boundary has to (docs/serving.md, "Limits").
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = [
    "MAX_GROUP_ID_LENGTH",
    "MAX_GROUP_SIZE",
    "SEED_MAX",
    "SEED_MIN",
    "check_int",
    "is_int",
    "positive_int",
]

#: The largest group size: member indices fit the lattice's 32-bit radical inverse and Sobol's
#: 32-bit points, and a stratified member's stratum is computed alone at any size up to it.
MAX_GROUP_SIZE = 2**32
#: Seeds: any signed or unsigned 64-bit word (what vLLM's msgpack transport carries);
#: a negative seed is its two's-complement word (``counter_rng.seed_to_u64``).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
#: Characters of a caller's group id (``qmc_group``).
MAX_GROUP_ID_LENGTH = 256


def is_int(value: Any) -> bool:
    """True for a Python int that is not a bool (JSON's true/false are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """``value`` if it is an integer in ``[low, high]``.

    Args:
        name: the field as the client wrote it (e.g. ``"sampler_seed"``,
            ``"vllm_xargs 'qmc_n'"``), for the message.

    Raises:
        ValueError: ``"{name}={value!r} must be an integer between {low} and {high}"``.
    """
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be an integer between {low} and {high}")
    return value


def positive_int(text: str) -> int:
    """An ``argparse`` type for the command lines' counts (qmc-eval's and qmc-serve's): an integer >= 1.

    Raises:
        argparse.ArgumentTypeError: ``'TEXT' is not an integer`` or ``N must be >= 1`` (argparse prints it
            after the option's name, one line, exit code 2).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value
