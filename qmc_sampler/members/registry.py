"""The member registry: admission, parking and resumption, around the draw cycle.

:class:`MemberRegistry` is where every caller that draws members meets the machinery: admission
(a new :class:`~qmc_sampler.members.member.Member` placed by the
:class:`~qmc_sampler.members.groups.GroupResolver`, or a preempted one found again among the
parked members by its token history, :mod:`qmc_sampler.members.history`), the draw → pending →
commit cycle it inherits (:class:`~qmc_sampler.members.cycle.DrawCycle`), and parking —
bounded, counted and logged (:class:`~qmc_sampler.members.parking.ParkedMembers`). How and why:
docs/internals.md, "The registry".
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from qmc_sampler.group import MemberState
from qmc_sampler.members.cycle import DrawCycle
from qmc_sampler.members.groups import GroupResolver
from qmc_sampler.members.history import history_fingerprints
from qmc_sampler.members.member import Member, RowSampling
from qmc_sampler.members.parking import ParkedMembers
from qmc_sampler.members.placement import GroupArgs

__all__ = ["MemberRegistry"]

logger = logging.getLogger("vllm.qmc_sampler")


@dataclass(kw_only=True)  # (a subclass's fields follow: keywords only, whatever the order)
class MemberRegistry(DrawCycle):
    """All members of one caller (an engine's processor, a generate call): placement, parking and
    the draw cycle (module docstring).

    Attributes:
        resolver: places new members in groups; the registry hooks its ``on_close`` to
            forget the parked members of an auto group that expires or is evicted.
        max_parked: bound on parked members in all; beyond it the least recently parked
            is dropped (counted in ``stats.parked_evicted``).
        max_parked_per_key: bound on parked members of one group key (a hot prompt's auto
            group, an explicit group); beyond it that key's oldest is dropped (counted in
            ``stats.parked_dropped``). A preempted request waits for at most the engine's
            batch to drain, so its member is dropped only if more than this many siblings
            leave the batch meanwhile. A dropped member whose request comes back continues
            as an unmatched one: a new member index, fresh counter-based uniforms (exact;
            counted in ``stats.lost``).
    """

    resolver: GroupResolver = field(default_factory=GroupResolver)
    max_parked: int = 65_536
    max_parked_per_key: int = 4_096
    _parked: ParkedMembers = field(default_factory=ParkedMembers)

    def __post_init__(self) -> None:
        # An auto group that the resolver closes (its TTL ran out, or it was evicted) can have
        # no more members: its parked ones would only hold memory until the LRU drops them.
        self.resolver.on_close = self._group_closed

    def admit(
        self,
        request: GroupArgs,
        sampling: RowSampling,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        identity: Hashable = None,
        again: bool = False,
    ) -> Member:
        """The member of a request entering the batch: its parked member back, or a new one.

        Args:
            request: the request's group arguments.
            sampling: its sampling parameters.
            prompt_ids: its prompt (auto groups are keyed by it).
            output_ids: the tokens it has generated so far (non-empty after preemption).
            identity: what names the request across removal and re-adding, if the caller
                knows (an object of the engine's that lives as long as the request, by id).
            again: the request ran before and its member was dropped (where the caller knows): no parked
                member is looked for, only ``len(output_ids)`` is read, and it is placed as a
                re-admitted request (never numbered again in its group).

        Returns:
            The member, in the batch (it has a pool row).
        """
        key = self.resolver.key(request, prompt_ids)
        # The output's history is hashed once here, whatever the number of parked members.
        at, after, history = history_fingerprints(output_ids) if not again else ((), None, -1)
        member = self._parked.take(key, identity, len(output_ids), at, after) if not again else None
        if member is not None:
            self.stats.restored += 1
            member.identity = identity
            self.resolver.joined(member.placement)
            if member.state.step == len(output_ids):
                member.pending = None  # the draw made before parking was discarded
            self._activate(member)
            logger.info(
                "qmc-sampler: member %d of group %s resumed at step %d with its carried state (%d so far)",
                member.placement.member,
                member.placement.label,
                len(output_ids),
                self.stats.restored,
            )
            return member
        # A request with a history that matched no parked member ran before: it is not numbered
        # again in its group (place's ``again``).
        placement = self.resolver.place(request, key, again=again or bool(output_ids))
        state = MemberState(spec=placement.spec, member=placement.member, fresh=placement.fresh)
        member = Member(placement, state, sampling, key, identity)
        self.stats.admitted += 1
        by_design = self.stats.admitted_by_design
        by_design[placement.spec.method] = by_design.get(placement.spec.method, 0) + 1
        self.resolver.joined(placement)
        if output_ids:
            self._lose(member, len(output_ids))
            member.history = history
        self._activate(member)
        return member

    def park(self, member: Member, accepted: int | None = None, last_token: int | None = None) -> None:
        """Keep a member whose row left the batch, in case its request comes back (preemption).

        It is filed by its history (:meth:`Member.fingerprints`); if its group key then holds
        more than :attr:`max_parked_per_key` parked members, the key's oldest is dropped, and
        if the registry holds more than :attr:`max_parked`, the least recently parked (each
        counted and logged).

        Args:
            member: a member in the batch.
            accepted, last_token: the engine's count of the request's accepted tokens and
                the last one, where the caller still knows them: the pending draw is
                then settled before parking, so a finished member never looks unstarted.
        """
        if accepted is not None:
            self.sync(member, accepted, last_token)
        self._deactivate(member)
        self.resolver.left(member.placement, member.last_step_at)
        self._parked.add(member)
        key = member.group_key
        if self._parked.count_of_group(key) > self.max_parked_per_key:
            self.stats.parked_dropped += 1
            oldest = next(self._parked.of_group(key))
            self._drop(oldest, self.stats.parked_dropped, "its group key held max_parked_per_key")
        while len(self._parked) > self.max_parked:
            self.stats.parked_evicted += 1
            self._drop(self._parked.oldest(), self.stats.parked_evicted, "the registry held max_parked")

    def reclaim(self, member: Member) -> bool:
        """Take a parked member back into the batch as it is (its request was only not
        scheduled for a while); False if a re-admitted request took it meanwhile."""
        if not self._parked.remove(member):  # out of the index: no admission may take a member in the batch
            return False
        self.resolver.joined(member.placement)
        self._activate(member)
        return True

    def parked(self) -> int:
        """How many members are parked now."""
        return len(self._parked)

    # ---- internals ----------------------------------------------------------
    def _now(self) -> float:
        return self.resolver.clock()  # the clock the resolver times auto groups by

    def _drop(self, member: Member, count: int, why: str) -> None:
        """Drop a parked member to keep a bound; ``count``: that bound's drops so far (logged)."""
        self._parked.remove(member)
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, …: loud, not a line per park
            logger.warning(
                "qmc-sampler: dropped parked member %d of group %s at step %d: %s. If its request was "
                "preempted it continues with fresh uniforms (still an exact sample). Dropped so far: %d",
                member.placement.member, member.placement.label, member.state.step, why, count,
            )  # fmt: skip

    def _group_closed(self, key: Hashable, why: str) -> None:
        """Forget the parked members of an auto group the resolver closed (``why``: expired or evicted)."""
        members = [m for m in self._parked.of_group(key) if m.placement.auto_key == key]
        if not members:
            return
        for member in members:
            self._parked.remove(member)
        self.stats.parked_expired += len(members)
        logger.info(
            "qmc-sampler: auto group %s %s: forgot its %d parked member(s) (a preempted one that comes back "
            "continues with fresh uniforms). Forgotten so far: %d",
            members[0].placement.label, why, len(members), self.stats.parked_expired,
        )  # fmt: skip
