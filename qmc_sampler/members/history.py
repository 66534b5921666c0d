"""Token histories: the rolling hash that finds a parked member again, on the host and the device.

A member's history is :func:`token_history` of its committed tokens; the device extends it
one token per step (:func:`extend_history`), exactly as the host would. A parked member is
filed under the *fingerprints* of the histories it may be resumed at
(:func:`member_fingerprints`), and a request coming back looks up those of its output
(:func:`history_fingerprints`): docs/internals.md, "Parked members".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

__all__ = ["extend_history", "history_fingerprints", "member_fingerprints", "token_history"]

# The two kinds of fingerprint: "at" a committed history (length, hash); "next" committed + a
# pending token (length, prefix hash, token).
_AT, _NEXT = "at", "next"

# Two 31-bit polynomial hashes side by side, one int64: each step's product stays below
# 2^51, so the device extends the hash in int64 arithmetic exactly as the host does.
_HASHES = ((2_147_483_647, 1_000_003), (2_147_483_629, 999_983))  # (prime modulus, multiplier)
_LOW = (1 << 31) - 1


def token_history(tokens: Iterable[int], h: int = 0) -> int:
    """A rolling hash of a token sequence, continued from ``h`` (equal sequences, equal hashes).

    Args:
        tokens: the tokens, in order.
        h: the hash of the tokens before them (0: none).

    Returns:
        A value in [0, 2^62): two polynomial hashes modulo primes below 2^31, packed.
    """
    (p1, m1), (p2, m2) = _HASHES
    high, low = h >> 31, h & _LOW
    for t in tokens:
        high = (high * m1 + int(t) + 2) % p1
        low = (low * m2 + int(t) + 2) % p2
    return (high << 31) | low


def extend_history(h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`token_history` of one more token per row, on the tensors' device.

    Args:
        h: ``[rows] int64``, each row's history so far.
        tokens: ``[rows] int64``, each row's next token.

    Returns:
        ``[rows] int64``, the extended histories (``h`` is not modified).
    """
    (p1, m1), (p2, m2) = _HASHES
    high = ((h >> 31) * m1 + tokens + 2) % p1
    low = ((h & _LOW) * m2 + tokens + 2) % p2
    return (high << 31) | low


def member_fingerprints(step: int, history: int, pending_token: int | None) -> list[tuple]:
    """The fingerprints of the histories a parked member may be resumed at.

    Args:
        step: its committed token count.
        history: :func:`token_history` of its committed tokens (-1: unknown, it lost its state).
        pending_token: the token of its draw still in doubt, or None.

    Returns:
        Up to two keys, comparable with :func:`history_fingerprints` of a request's output:
        ``("at", step, history)`` for its committed history (for step 0 only without a
        pending draw, and hash-free: every empty history is the same), and
        ``("next", step + 1, history, token)`` for committed + its pending token. A member
        whose history is unknown has no non-empty history.
    """
    keys: list[tuple] = []
    if step == 0:
        if pending_token is None:
            keys.append((_AT, 0, 0))
    elif history >= 0:
        keys.append((_AT, step, history))
    if pending_token is not None and history >= 0:
        keys.append((_NEXT, step + 1, history, int(pending_token)))
    return keys


def history_fingerprints(output_ids: Sequence[int]) -> tuple[tuple, tuple | None, int]:
    """What an admission looks up: ``output_ids`` as a committed history, and as committed +
    a pending token (its last one); one pass over the tokens.

    Args:
        output_ids: the request's output tokens so far (any length).

    Returns:
        ``(at, after, history)``: the ``"at"`` key of :func:`member_fingerprints` for this
        history, the ``"next"`` key (None for an empty history), and
        :func:`token_history` of ``output_ids``.
    """
    done = len(output_ids)
    if done == 0:
        return (_AT, 0, 0), None, 0
    last = int(output_ids[-1])
    prefix = token_history(itertools.islice(output_ids, done - 1))
    history = token_history((last,), prefix)  # the rolling hash goes on from the prefix's
    return (_AT, done, history), (_NEXT, done, prefix, last), history
