"""Groups and their members' cursors: uniforms in, tokens out, residual carried.

:class:`GroupSpec` names a group (method, n, seed, order). Each sequence being
generated is one :class:`MemberState`. :func:`sample_members` serves a batch of
rows from any mix of groups in one call:

1. each row's uniform: the design's u_{i,t} (per-step designs), the carried code
   (code designs), or a fresh counter-based uniform once the member is *alone*;
2. the processed distribution (:func:`qmc_sampler.processing.process_logits`) and
3. the inverse CDF (:func:`qmc_sampler.inverse_cdf.inverse_cdf`), fused on the
   fastest backend (:mod:`qmc_sampler.kernels`);
4. the residual carry u ← (u − F(y⁻)) / q(y) and the prefix width W ← W·q(y).
   Once W falls below the design's alone width (no other member can share the
   prefix) or below :data:`PRECISION_FLOOR` (the float64 code has too few bits
   left), the member continues with fresh uniforms. That switch is a stopping
   time of the member's own past, so each member stays an exact draw
   (``../shared/design/qmc-math.md`` §2, "Precision and alone members").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from qmc_sampler.counter_rng import Purpose, counter_uniform, seed_to_u64
from qmc_sampler.designs import DESIGNS, get_design
from qmc_sampler.inverse_cdf import ORDERS, Draw
from qmc_sampler.kernels import draw_by_order
from qmc_sampler.limits import MAX_GROUP_SIZE, SEED_MAX, SEED_MIN

__all__ = [
    "EXTENSIBLE",
    "PRECISION_FLOOR",
    "GroupSpec",
    "MemberState",
    "alone_width",
    "carry_codes",
    "carry_member",
    "carry_members",
    "draw_members",
    "member_uniforms",
    "sample_members",
]

#: Prefix width below which a carried code switches to fresh uniforms: after
#: consuming 32 of float64's 53 bits the residual still has ~2^-21 relative accuracy.
PRECISION_FLOOR = 2.0**-32

#: The group size of an *extensible* group: members 0, 1, 2, … join one at a time
#: and no size is ever assumed (only designs with ``extensible = True``).
EXTENSIBLE = 0


@dataclass(frozen=True)
class GroupSpec:
    """One group of correlated samples for one prompt.

    Attributes:
        method: the design, one of :data:`qmc_sampler.METHODS`.
        n: group size (≥ 1), or :data:`EXTENSIBLE` (0) for a group of unknown
            size that grows member by member (``iid``, ``lattice``, ``sobol``,
            ``antithetic``). For ``lattice``/``sobol`` use n = 2^m for the full
            balance properties.
        seed: group seed, an int in ``[SEED_MIN, SEED_MAX]`` (any 64-bit word); all randomness
            derives from it.
        order: vocabulary order, ``"id"`` or ``"sorted"``.

    Raises:
        ValueError: on an unknown method or order, n outside ``[0, MAX_GROUP_SIZE]`` (or n = 0
            for a design that needs its size), or a seed outside the 64-bit range.
    """

    method: str
    n: int
    seed: int
    order: str = "id"

    def __post_init__(self) -> None:
        design = get_design(self.method)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 0 <= self.n <= MAX_GROUP_SIZE:
            raise ValueError(
                f"n={self.n!r} is not a group size; use an int between 1 and {MAX_GROUP_SIZE} "
                "(or 0 for an extensible group)"
            )
        if self.n == EXTENSIBLE and not design.extensible:
            raise ValueError(
                f"method={self.method!r} needs its group size; extensible groups (n=0) take one of "
                f"{[m for m, d in DESIGNS.items() if d.extensible]}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed={self.seed!r} is not a seed; use an int between {SEED_MIN} and {SEED_MAX}")
        if self.order not in ORDERS:
            raise ValueError(f"order={self.order!r} is not a vocabulary order; use one of {set(ORDERS)}")
        if design.wants_power_of_two and self.n & (self.n - 1):
            warnings.warn(
                f"method={self.method!r} with n={self.n} (not a power of two): members stay exact, "
                "but the net's balance only holds for n = 2^m",
                stacklevel=3,
            )


@dataclass
class MemberState:
    """The cursor of one member: where it is, and what its design carries.

    Attributes:
        spec: the member's group.
        member: member index, in ``[0, spec.n)`` for a member of the design (any
            index ≥ 0 in an extensible group); an index ≥ n is a member beyond the
            group's size and must be ``fresh``.
        step: number of tokens generated so far (the next draw's step index t).
        code: the carried residual code (code designs; None before the first draw).
        width: W, the product of the probabilities of the tokens drawn from the code.
        fresh: True once the member draws fresh uniforms: alone, state lost, or
            beyond the group's size. Fresh uniforms are the counter stream
            (seed, FRESH, member, step), which no other member of the group uses.
    """

    spec: GroupSpec
    member: int
    step: int = 0
    code: float | None = None
    width: float = 1.0
    fresh: bool = False


def member_uniforms(states: Sequence[MemberState]) -> np.ndarray:
    """The uniform each member uses for its next draw, ``[len(states)] float64``."""
    out = np.empty(len(states), dtype=np.float64)
    by_method: dict[str, list[int]] = {}
    for j, s in enumerate(states):
        by_method.setdefault(s.spec.method, []).append(j)
    for method, rows in by_method.items():
        design = get_design(method)
        seeds = np.array([seed_to_u64(states[j].spec.seed) for j in rows], dtype=np.uint64)
        ns = np.array([states[j].spec.n for j in rows], dtype=np.int64)
        members = np.array([states[j].member for j in rows], dtype=np.int64)
        steps = np.array([states[j].step for j in rows], dtype=np.int64)
        fresh = np.array([states[j].fresh for j in rows])
        if design.carries:
            need_code = np.array([states[j].code is None for j in rows]) & ~fresh
            if need_code.any():
                codes = design.start_codes(seeds[need_code], ns[need_code], members[need_code])
                for j, c in zip(np.asarray(rows)[need_code], codes, strict=True):
                    states[j].code = float(c)
            designed = np.array([0.0 if states[j].code is None else states[j].code for j in rows])
        else:
            designed = design.step_uniforms(seeds, ns, members, steps)
        if fresh.any():
            designed = np.where(fresh, counter_uniform(seeds, Purpose.FRESH, members, steps), designed)
        out[rows] = designed
    return out


def carry_member(state: MemberState, uniform: float, start: float, prob: float) -> None:
    """Carry one member past an accepted draw: step + 1, residual code, prefix width.

    Args:
        state: the member; updated in place.
        uniform: the u it drew with; ``start``, ``prob``: the token's CDF interval.
    """
    carry_members([state], np.array([uniform]), np.array([start]), np.array([prob]))


def carry_members(states: Sequence[MemberState], uniforms: np.ndarray, starts: np.ndarray, probs: np.ndarray) -> None:
    """Carry a batch of members past their accepted draws (:func:`carry_codes` for the code designs).

    Args:
        states: the members; updated in place (step + 1; code, width and fresh for a member
            of a code design that is not fresh yet).
        uniforms, starts, probs: ``[len(states)] float64``, each member's u and its token's CDF interval.
    """
    carrying = []
    for j, s in enumerate(states):
        s.step += 1
        if get_design(s.spec.method).carries and not s.fresh:
            carrying.append(j)
    if not carrying:
        return
    rows = np.array(carrying)
    u, start, prob = (torch.from_numpy(np.asarray(a, dtype=np.float64)[rows]) for a in (uniforms, starts, probs))
    width = torch.tensor([states[j].width for j in carrying], dtype=torch.float64)
    alone = torch.tensor([alone_width(states[j].spec) for j in carrying], dtype=torch.float64)
    codes, widths, alone_now = carry_codes(u, start, prob, width, alone)
    for j, code, w, alone_from_now in zip(carrying, codes.tolist(), widths.tolist(), alone_now.tolist(), strict=True):
        s = states[j]
        s.code, s.width = code, w
        if alone_from_now:
            s.fresh = True


def carry_codes(
    uniform: torch.Tensor, start: torch.Tensor, prob: torch.Tensor, width: torch.Tensor, alone: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual carry of accepted draws, row by row: the one implementation of the host's and the device's.

    u ← (u − F(y⁻)) / q(y) and W ← W·q(y); the member is *alone* from now on once W falls
    below its alone width (``../shared/design/qmc-math.md`` §2).

    Args:
        uniform: ``[rows] float64``, the u each row drew with.
        start, prob: ``[rows] float64``, the drawn token's CDF interval F(y⁻) and q(y).
        width: ``[rows] float64``, the prefix width W before the draw.
        alone: ``[rows] float64``, each row's :func:`alone_width`.

    Returns:
        ``(code, width, alone_now)``: ``[rows] float64`` codes in [0, 1), ``[rows] float64``
        widths, and ``[rows] bool``, True where the member continues with fresh uniforms. On
        the inputs' device; nothing is modified in place.
    """
    # Rounding can push the quotient to 1.0 (or a hair below 0): the interval is half-open.
    code = ((uniform - start) / prob).clamp(0.0, math.nextafter(1.0, 0.0))
    width = width * prob
    return code, width, width < alone


def alone_width(spec: GroupSpec) -> float:
    """The prefix width below which a member of ``spec`` continues with fresh uniforms.

    Returns:
        Its design's alone width for ``spec.n``, or :data:`PRECISION_FLOOR` where that is larger.
    """
    return max(float(get_design(spec.method).alone_widths(np.array([spec.n]))[0]), PRECISION_FLOOR)


def advance(states: Sequence[MemberState], draw: Draw, uniforms: np.ndarray) -> None:
    """Carry every member of a batch past its draw (see :func:`carry_members`)."""
    carry_members(states, uniforms, draw.starts.cpu().numpy(), draw.probs.cpu().numpy())


def draw_members(
    logits: torch.Tensor,
    states: Sequence[MemberState],
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[Draw, np.ndarray]:
    """Draw one token per row from its member's design, leaving the members unchanged.

    Engines that may discard a draw (vLLM's chunked prefill) commit it later with
    :func:`carry_member`. Arguments as :func:`sample_members`.

    Returns:
        the :class:`Draw` and the ``[batch] float64`` uniforms used.
    """
    uniforms = member_uniforms(states)
    orders = [s.spec.order for s in states]
    return draw_by_order(logits, orders, torch.from_numpy(uniforms), temperature, top_k, top_p, min_p), uniforms


def sample_members(
    logits: torch.Tensor,
    states: Sequence[MemberState],
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> Draw:
    """Draw one token per row from its member's design and advance the members.

    Args:
        logits: ``[batch, vocab]`` raw logits, row j for ``states[j]``; not modified.
        states: one :class:`MemberState` per row; advanced in place.
        temperature, top_k, top_p, min_p: ``[batch]`` tensors, vLLM semantics
            (see :func:`qmc_sampler.processing.process_logits`).

    Returns:
        :class:`qmc_sampler.inverse_cdf.Draw` for the batch.

    Raises:
        ValueError: a row has NaN logits or no admissible token.
    """
    draw, uniforms = draw_members(logits, states, temperature, top_k, top_p, min_p)
    advance(states, draw, uniforms)
    return draw
