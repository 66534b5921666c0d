"""The member registry: every request with a design, its carried state, and the draw cycle.

vLLM tells a logits processor about rows (V1) or slots (Model Runner V2), not
requests, and a sampled token can still be thrown away (a chunked-prefill step
samples and discards). The registry is where both runners' adapters meet:

* **admission** (:meth:`MemberRegistry.admit`): a request entering the batch is
  either a preempted member coming back — matched among the parked members of
  its group by its identity and its *token history* (length and rolling hash) —
  or a new member, placed by :class:`~qmc_sampler.vllm_plugin.grouping.GroupResolver`;
* **the draw cycle**: :meth:`MemberRegistry.draw` picks each row's token from its
  member's design and keeps it *pending*; :meth:`MemberRegistry.sync` commits it
  to the member's carry only when the engine reports one more accepted token,
  and discards it when the count did not move (the row then redraws from the
  unchanged state);
* **parking** (:meth:`MemberRegistry.park`): a row that leaves the batch
  (finished or preempted — vLLM does not say which) keeps its member, holding
  only what resumption needs (no engine buffers), in an LRU of bounded size.

A re-admitted request whose member cannot be found (evicted, or a history that
matches no parked member) continues with fresh counter-based uniforms — still
an exact draw — and is counted and logged. Siblings with identical histories
are interchangeable (each continuation depends only on the prefix and the
code, and the group's set of codes is unchanged), so matching by history among
them is exact too.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from qmc_sampler.vllm_plugin.grouping import GroupResolver, Placement
from qmc_sampler.vllm_plugin.request_args import QMCRequest

from qmc_sampler.designs import get_design
from qmc_sampler.group import MemberState, carry_member, draw_members
from qmc_sampler.inverse_cdf import Draw

__all__ = ["Member", "MemberRegistry", "Pending", "RowSampling", "token_history"]

logger = logging.getLogger("vllm.qmc_sampler")

_HASH_MOD = (1 << 61) - 1


def token_history(tokens: Sequence[int], h: int = 0) -> int:
    """A rolling hash of a token sequence, continued from ``h`` (equal sequences, equal hashes)."""
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 2) % _HASH_MOD
    return h


@dataclass(frozen=True)
class RowSampling:
    """A request's sampling parameters, as the draw needs them (vLLM semantics)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float

    @classmethod
    def of(cls, params: Any) -> RowSampling:
        top_k = params.top_k if params.top_k and params.top_k > 0 else 0
        return cls(float(params.temperature), int(top_k), float(params.top_p), float(params.min_p))


@dataclass
class Pending:
    """A draw made for a row, not yet known to be accepted by the engine."""

    uniform: float
    start: float
    prob: float
    token: int


@dataclass
class Member:
    """One request (one member of a group) with a design."""

    placement: Placement
    state: MemberState
    sampling: RowSampling
    group_key: Hashable
    identity: Hashable = None  # the adapter's name for the request (no engine objects)
    pending: Pending | None = None
    history: int = 0  # token_history of the committed tokens
    engine_draws: bool = False  # this step's row is left to the engine (see MemberRegistry.leave_to_engine)
    degraded: bool = False  # it has had such a row (warned once per member)
    last_step_at: float | None = None  # wall clock of its last row in a batch (its group's TTL starts there)

    def consistent_with(self, output_ids: Sequence[int]) -> bool:
        """True if ``output_ids`` is this member's history: committed, or committed + its pending token.

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


@dataclass
class RegistryStats:
    """Counters of unusual events (logged when they happen)."""

    admitted: int = 0
    restored: int = 0
    lost: int = 0
    unsampleable: int = 0  # rows left to the engine: NaN, or no admissible token


@dataclass
class MemberRegistry:
    """All members of one processor: placement, parking and the draw cycle (module docstring)."""

    resolver: GroupResolver = field(default_factory=GroupResolver)
    max_parked: int = 65_536
    stats: RegistryStats = field(default_factory=RegistryStats)
    _parked: OrderedDict[int, Member] = field(default_factory=OrderedDict)  # LRU over all groups
    _parked_by_group: dict[Hashable, dict[int, Member]] = field(default_factory=dict)

    # ---- admission and parking ---------------------------------------------
    def admit(
        self,
        request: QMCRequest,
        sampling: RowSampling,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        identity: Hashable = None,
    ) -> Member:
        """The member of a request entering the batch: its parked member back, or a new one.

        Args:
            request: the request's group arguments (from ``extra_args``).
            sampling: its sampling parameters.
            prompt_ids: its prompt (auto groups are keyed by it).
            output_ids: the tokens it has generated so far (non-empty after preemption).
            identity: what names the request across removal and re-adding, if the
                adapter knows (V1: its output list's id; MRV2: its params object's id).
        """
        key = self.resolver.key(request, prompt_ids)
        member = self._unpark(key, identity, output_ids)
        if member is not None:
            self.stats.restored += 1
            member.identity = identity
            self.resolver.joined(member.placement)
            if member.state.step == len(output_ids):
                member.pending = None  # the draw made before parking was discarded
            logger.info(
                "qmc-sampler: member %d of group %s resumed at step %d with its carried state (%d so far)",
                member.placement.member,
                member.placement.label,
                len(output_ids),
                self.stats.restored,
            )
            return member
        placement = self.resolver.place(request, key)
        state = MemberState(spec=placement.spec, member=placement.member, fresh=placement.fresh)
        member = Member(placement, state, sampling, key, identity)
        self.stats.admitted += 1
        self.resolver.joined(placement)
        if output_ids:
            self._lose(member, len(output_ids))
            member.history = token_history(output_ids)
        return member

    def park(self, member: Member, accepted: int | None = None, last_token: int | None = None) -> None:
        """Keep a member whose row left the batch, in case its request comes back (preemption).

        Args:
            accepted, last_token: the engine's count of the request's accepted tokens and
                the last one, where the adapter still knows them (V1): the pending draw is
                then settled before parking, so a finished member never looks unstarted.
        """
        if accepted is not None:
            self.sync(member, accepted, last_token)
        self.resolver.left(member.placement, member.last_step_at)
        key = id(member)
        self._parked[key] = member
        self._parked_by_group.setdefault(member.group_key, {})[key] = member
        while len(self._parked) > self.max_parked:
            _, old = self._parked.popitem(last=False)
            self._forget(old)

    def reclaim(self, member: Member) -> bool:
        """Take a parked member back into the batch as it is (its request was only not
        scheduled for a while); False if a re-admitted request took it meanwhile."""
        if self._parked.pop(id(member), None) is None:
            return False
        self._forget(member)
        self.resolver.joined(member.placement)
        return True

    def parked(self) -> int:
        """How many members are parked now."""
        return len(self._parked)

    # ---- the draw cycle -----------------------------------------------------
    def sync(self, member: Member, accepted: int, last_token: int | None) -> None:
        """Reconcile a member with the engine's count of its accepted output tokens.

        Args:
            accepted: tokens the engine has accepted for this request so far.
            last_token: the last accepted token if known (None or -1: not known yet).
        """
        state = member.state
        engine_drew, member.engine_draws = member.engine_draws, False
        if accepted == state.step:
            member.pending = None  # the last draw was discarded (or none made yet): redraw
            return
        if engine_drew and accepted == state.step + 1:
            # The engine chose this token itself: nothing to carry, and the code's
            # coupling is gone, so carry designs continue with fresh uniforms.
            if get_design(state.spec.method).carries:
                state.fresh = True
            state.step = accepted
            member.history = token_history([last_token], member.history) if last_token not in (None, -1) else -1
            return
        p = member.pending
        if accepted == state.step + 1 and p is not None and last_token in (None, -1, p.token):
            carry_member(state, p.uniform, p.start, p.prob)
            member.history = token_history([p.token], member.history)
            member.pending = None
            return
        self._lose(member, accepted)

    def draw(
        self, logits: torch.Tensor, members: Sequence[Member], *, temperature_applied: bool
    ) -> tuple[Draw, np.ndarray]:
        """Each member's token for its row of ``logits`` (``[len(members), vocab]``), kept pending.

        Args:
            temperature_applied: True where the engine already applied temperature
                and min-p (V1 runner); the draw then applies top-k/top-p only.

        Returns:
            The :class:`~qmc_sampler.inverse_cdf.Draw` and the uniforms used.
        """
        ones = torch.ones(len(members))
        draw, uniforms = draw_members(
            logits,
            [m.state for m in members],
            temperature=ones if temperature_applied else torch.tensor([m.sampling.temperature for m in members]),
            top_k=torch.tensor([m.sampling.top_k for m in members]),
            top_p=torch.tensor([m.sampling.top_p for m in members]),
            min_p=None if temperature_applied else torch.tensor([m.sampling.min_p for m in members]),
        )
        starts, probs, tokens = draw.starts.tolist(), draw.probs.tolist(), draw.tokens.tolist()
        now = self.resolver.clock()
        for j, m in enumerate(members):
            m.pending = Pending(uniform=float(uniforms[j]), start=starts[j], prob=probs[j], token=tokens[j])
            m.last_step_at = now
        return draw, uniforms

    def leave_to_engine(self, members: Sequence[Member], why: str) -> None:
        """Let the engine sample these members' rows itself this step (a row the inverse CDF cannot
        draw from: NaN logits, or every token masked by the request's own constraints).

        The request then gets exactly what vLLM gives it without the plugin, instead of an
        exception inside the engine step (which would take the engine down for every user).
        Each member warns once; :attr:`RegistryStats.unsampleable` counts every such row.
        """
        now = self.resolver.clock()
        for m in members:
            self.stats.unsampleable += 1
            m.pending = None
            m.engine_draws = True
            m.last_step_at = now
            if not m.degraded:
                m.degraded = True
                logger.warning(
                    "qmc-sampler: member %d of group %s, step %d: %s; the engine samples that row itself and the "
                    "member continues with fresh uniforms. Rows left to the engine so far: %d",
                    m.placement.member,
                    m.placement.label,
                    m.state.step,
                    why,
                    self.stats.unsampleable,
                )

    # ---- internals ----------------------------------------------------------
    def _lose(self, member: Member, accepted: int) -> None:
        self.stats.lost += 1
        state = member.state
        # Per-step designs carry nothing, so nothing is lost: their member index
        # still gives them their own uniforms at every step.
        if get_design(state.spec.method).carries:
            state.fresh = True
        state.step = accepted
        member.pending = None
        logger.warning(
            "qmc-sampler: member %d of group %s lost its carried state at step %d; it continues with "
            "fresh uniforms (still an exact sample). Lost so far: %d",
            member.placement.member,
            member.placement.label,
            accepted,
            self.stats.lost,
        )

    def _unpark(self, key: Hashable, identity: Hashable, output_ids: Sequence[int]) -> Member | None:
        candidates = [m for m in self._parked_by_group.get(key, {}).values() if m.consistent_with(output_ids)]
        found = None
        if identity is not None:
            found = next((m for m in candidates if m.identity == identity), None)
        # Matching by history alone needs a history: a new request arrives with
        # none, and must never take a parked sibling's member.
        if found is None and output_ids and candidates:
            # Most specific first: a member exactly at this history, then one whose
            # pending draw is the last accepted token.
            found = next((m for m in candidates if m.state.step == len(output_ids)), candidates[0])
        if found is not None:
            del self._parked[id(found)]
            self._forget(found)
        return found

    def _forget(self, member: Member) -> None:
        group = self._parked_by_group.get(member.group_key)
        if group is not None:
            group.pop(id(member), None)
            if not group:
                del self._parked_by_group[member.group_key]
