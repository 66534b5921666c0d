"""Who is which member: group resolution in the worker.

:class:`GroupResolver` places every request with a design in exactly one group, as one member
index of it (a :class:`Placement`), when it first enters the engine's batch: an *explicit* group
(``qmc_group``), a *request* group (the children of one ``n > 1`` request) or an *auto* group
(repeats of one ``n = 1`` prompt: an extensible lattice, open for its ttl), seeded and salted by
engine (:class:`EngineSalt`, :func:`stable_seed`) and counted in :class:`GroupStats`. The rules —
kinds, seeds, lifetimes, members beyond a group's size — are specified in docs/internals.md,
"Groups".
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
from qmc_sampler.vllm_plugin.request_args import AUTO, EXPLICIT, QMCRequest

from qmc_sampler.counter_rng import Purpose, counter_seed, seed_to_u64
from qmc_sampler.group import EXTENSIBLE, GroupSpec

__all__ = ["EngineSalt", "GroupResolver", "GroupStats", "Placement", "stable_seed"]

logger = logging.getLogger("vllm.qmc_sampler")


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a tuple of values, the same in every process (blake2b of their repr)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class EngineSalt:
    """What tells this engine apart from others that may serve the same requests."""

    engine_seed: int = 0
    dp_rank: int = 0


@dataclass(frozen=True)
class Placement:
    """A request's place: its group's spec, its member index, and its group's label.

    ``fresh`` is True for a member beyond its group's size (see module docstring).
    ``auto_key`` identifies the auto group (None for the other kinds).
    """

    label: str
    spec: GroupSpec
    member: int
    fresh: bool = False
    auto_key: Hashable | None = None


@dataclass
class GroupStats:
    """Counters of group resolution (reported by ``plugin_stats``)."""

    overflow: int = 0  # members beyond their group's n (fresh, own stream)
    auto_groups: int = 0  # auto groups started (or started again)
    auto_members: int = 0  # requests placed in auto groups
    auto_expired: int = 0  # auto groups closed after their time-to-live
    auto_evicted: int = 0  # auto groups forgotten because too many were open


@dataclass
class _AutoGroup:
    seed: int
    next_member: int = 0
    live: int = 0
    idle_since: float = 0.0


@dataclass
class GroupResolver:
    """Places requests in groups (see the module docstring for the rules).

    Attributes:
        salt: this engine's identity; max_open_groups: bound on remembered auto
            groups (and on arrival counters of the other kinds); clock: the wall
            clock (seconds, comparable with the front-end's ``time.time()``).
        on_close: called with ``(key, why)`` when an auto group is closed — expired
            (``why`` = "expired") or evicted ("evicted") — so its parked members go
            with it; set by :class:`~qmc_sampler.vllm_plugin.registry.MemberRegistry`.
            Groups expire lazily: when a repeat arrives after the TTL (a sweep by the
            clock could close a group that a queued repeat, stamped within the TTL,
            should still join).
    """

    salt: EngineSalt = field(default_factory=EngineSalt)
    max_open_groups: int = 4096
    clock: Callable[[], float] = time.time
    stats: GroupStats = field(default_factory=GroupStats)
    on_close: Callable[[Hashable, str], None] | None = None
    _arrivals: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _derived: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _auto: OrderedDict[Hashable, _AutoGroup] = field(default_factory=OrderedDict)
    _clock: float = 0.0
    _counter: int = 0

    def key(self, request: QMCRequest, prompt_ids: Sequence[int]) -> Hashable:
        """The key of the group a request belongs to (its parked siblings are filed under it)."""
        if request.kind != AUTO:
            return request.group
        prompt = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=16).hexdigest()
        return (request.method, request.order, request.seed, request.params_key, prompt)

    def place(self, request: QMCRequest, key: Hashable) -> Placement:
        """The placement of a request entering the batch as a new member of group ``key``."""
        self._clock = max(self._clock, request.arrival)
        if request.kind == AUTO:
            return self._place_auto(request, key)
        seed = request.seed
        if seed is None and request.fresh_seed is not None:
            seed = self._salted(request.fresh_seed)
        elif seed is None:
            seed = self._derived_seed(request.group)
        elif request.kind != EXPLICIT:
            seed = self._salted(seed)
        if request.index is None:
            member = self._next_arrival(request.group)
        elif request.children > 1:  # children of one n > 1 request: index, index + 1, …
            member = request.index + self._next_arrival(f"{request.group}#{request.tag}")
        else:
            member = request.index
        spec = GroupSpec(request.method, request.n, seed, request.order)
        fresh = member >= request.n
        if fresh:
            self.stats.overflow += 1
            logger.warning(
                "qmc-sampler: group %s got more than n=%d members; member %d draws fresh uniforms of its own "
                "(exact, not correlated). Overflow so far: %d",
                request.group,
                request.n,
                member,
                self.stats.overflow,
            )
        return Placement(request.group, spec, member, fresh)

    def joined(self, placement: Placement) -> None:
        """A member of an auto group is (back) in the batch."""
        group = self._auto.get(placement.auto_key) if placement.auto_key is not None else None
        if group is not None:
            group.live += 1

    def left(self, placement: Placement, last_step_at: float | None = None) -> None:
        """A member of an auto group left the batch (finished or preempted).

        Args:
            last_step_at: the wall clock of the member's last step in the batch, where known:
                the engine reports a finished request's removal only at its next step, which
                an idle engine (an in-process ``LLM`` between ``generate`` calls) takes only
                with the next work; the member left when it last drew. None: now.
        """
        group = self._auto.get(placement.auto_key) if placement.auto_key is not None else None
        if group is not None and group.live > 0:
            group.live -= 1
            if group.live == 0:
                left_at = self.clock() if last_step_at is None else last_step_at
                group.idle_since = max(self._clock, left_at)

    def open_auto_groups(self) -> int:
        """How many auto groups are remembered now."""
        return len(self._auto)

    # ---- the three kinds ----------------------------------------------------
    def _place_auto(self, request: QMCRequest, key: Hashable) -> Placement:
        group = self._auto.get(key)
        if group is not None and group.live == 0 and request.arrival - group.idle_since > request.ttl:
            del self._auto[key]
            self.stats.auto_expired += 1
            self._closed(key, "expired")
            group = None
        if group is None:
            group = self._open_auto(key, request)
        self._auto.move_to_end(key)
        member = group.next_member
        group.next_member += 1
        self.stats.auto_members += 1
        spec = GroupSpec(request.method, EXTENSIBLE, group.seed, request.order)
        return Placement(f"auto:{key[-1][:12]}:{group.seed}", spec, member, auto_key=key)

    def _open_auto(self, key: Hashable, request: QMCRequest) -> _AutoGroup:
        if request.seed is not None:
            seed = stable_seed("auto", request.seed, key, self.salt.engine_seed, self.salt.dp_rank)
        elif request.fresh_seed is not None:
            seed = stable_seed("auto-fresh", request.fresh_seed, self.salt.dp_rank)
        else:
            seed = self._next_counter_seed()
        group = _AutoGroup(seed=seed)
        self._auto[key] = group
        self.stats.auto_groups += 1
        self._evict_idle(keep=key)
        return group

    def _evict_idle(self, keep: Hashable) -> None:
        # Live groups are never forgotten (their members are bounded by the batch);
        # the longest-idle ones go first. The group being opened is kept too: its member
        # is not live yet, and placing it needs the group (evicting it was a KeyError in
        # the engine step). With every other group live, more than max_open_groups stay
        # open until some go idle: live groups are bounded by the batch.
        for key in list(self._auto):
            if len(self._auto) <= self.max_open_groups:
                return
            if self._auto[key].live == 0 and key != keep:
                del self._auto[key]
                self.stats.auto_evicted += 1
                self._closed(key, "evicted")

    def _closed(self, key: Hashable, why: str) -> None:
        """Report a closed auto group to ``on_close``."""
        if self.on_close is not None:
            self.on_close(key, why)

    def _next_arrival(self, group: str) -> int:
        member = self._arrivals.pop(group, 0)
        self._arrivals[group] = member + 1
        while len(self._arrivals) > self.max_open_groups:
            self._arrivals.popitem(last=False)
        return member

    def _derived_seed(self, group: str) -> int:
        if group not in self._derived:
            self._derived[group] = self._next_counter_seed()
            while len(self._derived) > self.max_open_groups:
                self._derived.popitem(last=False)
        return self._derived[group]

    def _next_counter_seed(self) -> int:
        self._counter += 1
        return counter_seed(seed_to_u64(self.salt.engine_seed), Purpose.GROUP_SEED, self.salt.dp_rank, self._counter)

    def _salted(self, seed: int) -> int:
        # Rank 0 keeps the user's seed as it is, so a single engine reproduces
        # the same groups as before data parallelism.
        return seed if self.salt.dp_rank == 0 else stable_seed("dp", seed, self.salt.dp_rank)
