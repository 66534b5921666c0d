"""One member: a request with a design, its placement, its cursor and its draw in doubt.

:class:`Member` is what the registry keeps per request; :class:`Pending` is a draw made for it
that the engine has not yet accepted or discarded; :class:`RowSampling` is the request's
sampling parameters as the draw needs them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from qmc_sampler.group import MemberState
from qmc_sampler.members.history import member_fingerprints, token_history
from qmc_sampler.members.placement import Placement

__all__ = ["Member", "Pending", "RowSampling"]


@dataclass(frozen=True)
class RowSampling:
    """A request's sampling parameters, as the draw needs them (vLLM semantics: ``top_k = 0`` is off)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float


@dataclass
class Pending:
    """A draw made for a member, not yet known to be accepted by the engine."""

    uniform: float
    start: float
    prob: float
    token: int


@dataclass
class Member:
    """One request (one member of a group) with a design.

    While the member is in the batch (``slot >= 0``) its numbers live in the registry's
    :class:`~qmc_sampler.members.pool.DevicePool` and ``state.code``/``width``/``fresh``,
    ``pending`` and ``history`` are stale; ``state.step`` is always the host's. Parking reads
    the pool row back.
    """

    placement: Placement
    state: MemberState
    sampling: RowSampling
    group_key: Hashable
    identity: Hashable = None  # the caller's name for the request (no engine objects)
    pending: Pending | None = None  # a parked member's draw still in doubt
    history: int = 0  # token_history of the committed tokens
    left_to_engine: bool = False  # this step's row is left to the engine (see MemberRegistry.leave_to_engine)
    degraded: bool = False  # it has had such a row (warned once per member)
    last_step_at: float | None = None  # wall clock of its last row in a batch (its group's TTL starts there)
    slot: int = -1  # its row of the device pool while in the batch
    draw_pending: bool = False  # in the batch: a draw is pending on the device

    def consistent_with(self, output_ids: Sequence[int]) -> bool:
        """True if ``output_ids`` is this (parked) member's history: committed, or committed + its pending token.

        The specification of matching: the registry files parked members under the
        fingerprints of exactly these histories (:meth:`fingerprints`) and never calls
        this per candidate.

        An empty history matches only a member that never drew a token still in doubt: a
        member parked with a pending first draw may have emitted it (a request that
        finished after one token), and a new request must not take its code.
        """
        done = len(output_ids)
        if done == 0:
            return self.state.step == 0 and self.pending is None
        if self.state.step == done:
            return self.history == token_history(output_ids)
        return (
            self.state.step + 1 == done
            and self.pending is not None
            and self.pending.token == output_ids[-1]
            and self.history == token_history(output_ids[:-1])
        )

    def fingerprints(self) -> list[tuple]:
        """The fingerprints of the histories this (parked) member is :meth:`consistent_with`.

        Returns:
            Up to two keys (:func:`~qmc_sampler.members.history.member_fingerprints`),
            comparable with :func:`~qmc_sampler.members.history.history_fingerprints` of a
            request's output.
        """
        pending = self.pending
        return member_fingerprints(self.state.step, self.history, None if pending is None else pending.token)
