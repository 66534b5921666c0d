"""The reference loop: one group, sampled step by step from a logits function.

Used by the tests, the docs and the other components as the definition of what a
group of correlated samples is. Engines (the vLLM plugin, the server) must produce
the same sequences for the same group and the same model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from qmc_sampler.group import GroupSpec, MemberState, sample_members
from qmc_sampler.processing import SAMPLING_EPS

__all__ = ["sample_group", "validate_sampling"]

NextLogits = Callable[[list[list[int]]], torch.Tensor]


def validate_sampling(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """Check sampling parameters at a boundary; vLLM's ranges and meanings.

    Raises:
        ValueError: naming the parameter, its value and the allowed range.
    """
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < SAMPLING_EPS:
        raise ValueError(
            f"temperature={temperature!r} must be a finite number >= {SAMPLING_EPS}; "
            "temperature 0 is greedy decoding, which has no randomness to correlate"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"top_k={top_k!r} must be an int >= 1, or 0 / -1 to disable it")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]; 1 disables it")
    if not isinstance(min_p, (int, float)) or not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p={min_p!r} must be in [0, 1]; 0 disables it")


def sample_group(
    next_logits: NextLogits,
    spec: GroupSpec,
    max_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    eos_token_id: int | None = None,
) -> list[list[int]]:
    """Generate the n sequences of one group.

    Args:
        next_logits: maps the unfinished members' prefixes (generated tokens only,
            in member order) to their next-token logits ``[len(prefixes), vocab]``.
        spec: the group (method, n, seed, order).
        max_tokens: the most tokens per member (≥ 0).
        temperature, top_k, top_p, min_p: vLLM's sampling parameters and semantics
            (top_k 0 or -1 disables).
        eos_token_id: a member stops after drawing this token (it is included).

    Returns:
        ``n`` token lists, member 0 first.

    Raises:
        ValueError: invalid arguments, or logits of the wrong shape, NaN, or a row
            with no admissible token.
    """
    validate_sampling(temperature, top_k, top_p, min_p)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 0")
    states = [MemberState(spec=spec, member=i) for i in range(spec.n)]
    sequences: list[list[int]] = [[] for _ in range(spec.n)]
    active = list(range(spec.n))
    for _ in range(max_tokens):
        if not active:
            break
        logits = next_logits([list(sequences[i]) for i in active])
        if logits.dim() != 2 or logits.shape[0] != len(active):
            raise ValueError(f"next_logits returned shape {tuple(logits.shape)}; expected [{len(active)}, vocab]")
        rows = len(active)
        draw = sample_members(
            logits,
            [states[i] for i in active],
            temperature=torch.full((rows,), float(temperature)),
            top_k=torch.full((rows,), max(top_k, 0), dtype=torch.long),
            top_p=torch.full((rows,), float(top_p)),
            min_p=torch.full((rows,), float(min_p)),
        )
        still = []
        for i, tok in zip(active, draw.tokens.tolist(), strict=True):
            sequences[i].append(tok)
            if tok != eos_token_id:
                still.append(i)
        active = still
    return sequences
