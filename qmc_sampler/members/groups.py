"""Who is which member: group resolution where the members are drawn.

:class:`GroupResolver` places every request with a design in exactly one group, as one member
index of it (a :class:`~qmc_sampler.members.placement.Placement`), when it first enters the
batch: an *explicit* group (``qmc_group``), a *per-request* group (one request's own members:
an ``n > 1`` request's children, or a lone request with auto-grouping off) or an *auto* group
(repeats of one ``n = 1`` prompt: an extensible lattice, open for its ttl), seeded and salted by
engine (:class:`EngineSalt`, :func:`~qmc_sampler.counter_rng.stable_seed`) and counted in
:class:`GroupStats`. The rules — kinds, seeds, lifetimes, members beyond a group's size — are
specified in docs/internals.md, "Groups".

One member, once: every member index that comes from a counter kept here (members numbered in
arrival order) is handed out at most once per group seed. Where such a counter may have been
forgotten (its LRU bound) or never seen (another engine, a restart, a re-admitted request), the
member's group seed or the member itself is new: explicit groups without ``qmc_index`` are seeded
by the front end's instance salt, the engine's rank and the count of forgotten counters (an
*epoch*); a re-admitted request, or a child whose counter was forgotten, draws as an *orphan* (a
seed of its own, fresh uniforms). Each such event is counted in :class:`GroupStats` and logged.

The children of one ``n > 1`` request need no counter where the front end marked each with its
place in the request (``GroupArgs.child``): vLLM's data-parallel balancer may send them to
different engines, and each is still member (index +) child of the one group, on any engine.
Unmarked children are numbered by arrival in their engine, under a seed salted by the engine's
rank (every rank but 0), so a request split over engines never draws a member twice.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from qmc_sampler.counter_rng import Purpose, counter_seed, seed_to_u64, stable_seed
from qmc_sampler.group import EXTENSIBLE, GroupSpec
from qmc_sampler.members.placement import AUTO, EXPLICIT, PER_REQUEST, GroupArgs, Placement

__all__ = ["EngineSalt", "GroupResolver", "GroupStats"]

logger = logging.getLogger("vllm.qmc_sampler")

#: Keys of forgotten children counters are remembered this many times max_open_groups.
_FORGOTTEN_PER_OPEN = 16
#: What is logged when an auto group is closed (its ttl or max_open_groups, and the count so far).
_EXPIRED = (
    "qmc-sampler: an auto group expired (idle longer than its ttl of %.0f s); a later repeat starts "
    "it again (a seeded one from member 0, as vLLM's seeded requests repeat). Expired so far: %d"
)
_EVICTED = (
    "qmc-sampler: forgot an idle auto group (more than max_open_groups=%d open); a later "
    "repeat starts it again (a seeded one from member 0). Evicted so far: %d"
)


@dataclass(frozen=True)
class EngineSalt:
    """What tells this engine apart from others that may serve the same requests (the
    front end's per-engine-client salt travels with each request: ``GroupArgs.salt``)."""

    engine_seed: int = 0
    dp_rank: int = 0


@dataclass
class GroupStats:
    """Counters of group resolution (reported by ``plugin_stats``)."""

    overflow: int = 0  # members beyond their group's n (fresh, own stream)
    auto_groups: int = 0  # auto groups started (or started again)
    auto_members: int = 0  # requests placed in auto groups
    auto_expired: int = 0  # auto groups closed after their time-to-live
    auto_evicted: int = 0  # auto groups forgotten because too many were open
    arrivals_forgotten: int = 0  # arrival counters dropped by the bound (explicit groups: a new epoch)
    children_forgotten: int = 0  # counters of n > 1 children dropped before every child arrived
    orphans: int = 0  # members placed with a seed of their own: re-admitted, or their counter forgotten
    children_lost: int = 0  # forgotten children counters no longer remembered as forgotten (see _next_child)
    children_unmarked: int = 0  # children of an indexed request numbered on a rank > 0 without their place (salted)


@dataclass
class GroupResolver:
    """Places requests in groups (see the module docstring for the rules).

    Attributes:
        salt: this engine's identity; max_open_groups: bound on remembered auto
            groups (and on arrival counters of the other kinds); clock: the wall
            clock (seconds, comparable with the front-end's ``time.time()``).
        on_close: called with ``(key, why)`` when an auto group is closed — expired
            (``why`` = "expired") or evicted ("evicted") — so its parked members go
            with it; set by :class:`~qmc_sampler.members.registry.MemberRegistry`.
            Groups expire lazily: when a repeat arrives after the TTL (a sweep by the
            clock could close a group that a queued repeat, stamped within the TTL,
            should still join).
    """

    salt: EngineSalt = field(default_factory=EngineSalt)
    max_open_groups: int = 4096
    clock: Callable[[], float] = time.time
    stats: GroupStats = field(default_factory=GroupStats)
    on_close: Callable[[Hashable, str], None] | None = None
    # explicit groups without qmc_index: group → [next member, the group seed of this counter's epoch]
    _arrivals: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)
    # children of one n > 1 request (its group, or group#tag): key → [next child, children]
    _children: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)
    # keys of children counters dropped before every child arrived (their later children are orphans)
    _forgotten: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _derived: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _auto: OrderedDict[Hashable, _AutoGroup] = field(default_factory=OrderedDict)
    _clock: float = 0.0
    _counter: int = 0

    def key(self, request: GroupArgs, prompt_ids: Sequence[int]) -> Hashable:
        """The key of the group a request belongs to (its parked siblings are filed under it)."""
        if request.kind != AUTO:
            return request.group
        prompt = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=16).hexdigest()
        return (request.method, request.order, request.seed, request.params_key, prompt)

    def place(self, request: GroupArgs, key: Hashable, again: bool = False) -> Placement:
        """The placement of a request entering the batch as a new member of group ``key``.

        Args:
            again: the request ran before (re-admitted after its parked member was dropped):
                where its member index came from a counter, it is not numbered again (the
                counter may have moved on, or been forgotten) but drawn as an orphan.
        """
        self._clock = max(self._clock, request.arrival)
        if request.kind == AUTO:
            return self._place_auto(request, key)
        # A child the front end marked with its place in its request is its request's member
        # (index +) child wherever it runs: no counter, no salt by engine, so a request whose
        # children vLLM's data-parallel balancer spreads over engines stays one whole group.
        marked = request.child is not None and (request.kind == PER_REQUEST or request.index is not None)
        numbered = not marked and (request.index is None or request.children > 1)  # an index from a counter here
        if numbered and (again or self._forgotten_child(request)):
            return self._orphan(request, "it was admitted again" if again else "its children's counter was forgotten")
        seed = request.seed
        if seed is None and request.fresh_seed is not None:
            seed = request.fresh_seed if marked else self._salted(request.fresh_seed)
        elif seed is None:
            seed = self._derived_seed(request.group)
        elif request.kind != EXPLICIT and not marked:
            seed = self._salted(seed)
        if request.index is None and request.kind == EXPLICIT:
            member, seed = self._next_arrival(request.group, seed, request.salt)
        elif marked:  # children of one n > 1 request, each with its place in it: index + child
            member = (request.index or 0) + int(request.child)  # type: ignore[arg-type]
        elif request.index is None:  # the children of one n > 1 request: 0 … n − 1
            member = self._next_child(request.group, request.n)
        elif request.children > 1:  # children of one n > 1 request: index, index + 1, …
            member = request.index + self._next_child(f"{request.group}#{request.tag}", request.children)
            seed = self._unmarked_children_seed(request, seed)
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
    def _place_auto(self, request: GroupArgs, key: Hashable) -> Placement:
        group = self._auto.get(key)
        if group is not None and group.live == 0 and request.arrival - group.idle_since > request.ttl:
            self.stats.auto_expired += 1
            self._forget(key, "expired", _EXPIRED, request.ttl, self.stats.auto_expired)
            group = None
        if group is None:
            group = self._open_auto(key, request)
        self._auto.move_to_end(key)
        member = group.next_member
        group.next_member += 1
        self.stats.auto_members += 1
        spec = GroupSpec(request.method, EXTENSIBLE, group.seed, request.order)
        return Placement(f"auto:{key[-1][:12]}:{group.seed}", spec, member, auto_key=key)

    def _open_auto(self, key: Hashable, request: GroupArgs) -> _AutoGroup:
        if request.seed is not None:
            # The instance salt: two replicas (or engines) started alike never build the same group
            # from the same seeded repeats (pinned with QMC_SAMPLER_SALT for reproducible groups).
            seed = stable_seed("auto", request.seed, key, self.salt.engine_seed, self.salt.dp_rank, request.salt)
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
                self.stats.auto_evicted += 1
                self._forget(key, "evicted", _EVICTED, self.max_open_groups, self.stats.auto_evicted)

    def _forget(self, key: Hashable, why: str, message: str, *args: object) -> None:
        """Close an auto group: forget it, log ``message % args`` (counted) and report it to ``on_close``."""
        del self._auto[key]
        _log_counted(message, *args)
        self._closed(key, why)

    def _closed(self, key: Hashable, why: str) -> None:
        """Report a closed auto group to ``on_close``."""
        if self.on_close is not None:
            self.on_close(key, why)

    def _next_arrival(self, group: str, seed: int, salt: int) -> tuple[int, int]:
        """The next member of an explicit group numbered by arrival, and the group seed it draws with.

        The seed is the group's seed salted by the front end's instance salt, this engine's
        rank and the epoch (forgotten counters so far) in which this counter opened: two
        engines, two replicas, an engine before and after a restart, or a counter before and
        after it was forgotten, never number the same group seed from 0 twice.
        """
        entry = self._arrivals.pop(group, None)
        if entry is None:
            epoch = self.stats.arrivals_forgotten
            entry = [0, stable_seed("arrivals", seed, salt, self.salt.dp_rank, epoch)]
        member = entry[0]
        entry[0] += 1
        self._arrivals[group] = entry
        while len(self._arrivals) > self.max_open_groups:
            old, (count, _) = self._arrivals.popitem(last=False)
            self.stats.arrivals_forgotten += 1
            _log_counted(
                "qmc-sampler: forgot the arrival counter of explicit group %s after %d members (more than "
                "max_open_groups=%d are open); its later members form a new group with a seed of its own "
                "(never a used member; not correlated with the earlier ones). Forgotten so far: %d",
                old, count, self.max_open_groups, self.stats.arrivals_forgotten,
            )  # fmt: skip
        return member, entry[1]

    def _next_child(self, key: str, children: int) -> int:
        """The next child of one ``n > 1`` request (0 … children − 1; later ones overflow)."""
        entry = self._children.pop(key, None) or [0, children]
        member = entry[0]
        entry[0] += 1
        self._children[key] = entry
        if len(self._children) > self.max_open_groups:
            # The counters whose children have all arrived go first: only a re-admitted child,
            # numbered apart (an orphan), comes after them.
            done = next((k for k, (count, n) in self._children.items() if count >= n), None)
            old = done if done is not None else next(iter(self._children))
            count, n = self._children.pop(old)
            if count < n:
                self.stats.children_forgotten += 1
                self._forgotten[old] = None
                while len(self._forgotten) > _FORGOTTEN_PER_OPEN * self.max_open_groups:
                    # Remembered 16 times longer than open counters: a child arriving after even
                    # this is numbered from 0 again — counted and logged, never silent.
                    self._forgotten.popitem(last=False)
                    self.stats.children_lost += 1
                    _log_counted(
                        "qmc-sampler: forgot a forgotten children counter too; a child of it arriving now would "
                        "repeat a member index. Lost so far: %d",
                        self.stats.children_lost,
                    )  # fmt: skip
                _log_counted(
                    "qmc-sampler: forgot the children counter of %s after %d of its %d children (more than "
                    "max_open_groups=%d open); its later children draw as orphans (a seed of their own). "
                    "Forgotten so far: %d",
                    old, count, n, self.max_open_groups, self.stats.children_forgotten,
                )  # fmt: skip
        return member

    def _unmarked_children_seed(self, request: GroupArgs, seed: int) -> int:
        """The group seed of children numbered here of an explicit request with ``qmc_index``, which
        the front end did not mark with their place in their request (a vLLM whose fan-out it cannot
        see). Another engine may number the same request's other children from the same index, so
        every engine but rank 0 salts the seed by its rank: distinct members, one group per engine
        instead of one whole group (counted and logged), never a member drawn twice."""
        if self.salt.dp_rank == 0:
            return seed
        self.stats.children_unmarked += 1
        _log_counted(
            "qmc-sampler: the children of a request of group %s reach data-parallel rank %d without their place "
            "in their request (the front end could not mark them); numbered here under a seed salted by this "
            "engine's rank: distinct members, not members of the group named. Such children so far: %d",
            request.group, self.salt.dp_rank, self.stats.children_unmarked,
        )  # fmt: skip
        return stable_seed("unmarked-children", seed, self.salt.dp_rank)

    def _forgotten_child(self, request: GroupArgs) -> bool:
        if request.kind == EXPLICIT and request.index is None:
            return False
        key = request.group if request.index is None else f"{request.group}#{request.tag}"
        return key in self._forgotten and key not in self._children

    def _orphan(self, request: GroupArgs, why: str) -> Placement:
        """A member with a group seed of its own (member 0 of a group nobody else joins), fresh uniforms."""
        self.stats.orphans += 1
        self._counter += 1
        seed = stable_seed("orphan", request.salt, self.salt.engine_seed, self.salt.dp_rank, self._counter)
        _log_counted(
            "qmc-sampler: a member of group %s draws with a seed of its own (%s): an exact sample, not "
            "correlated with its group. Orphans so far: %d",
            request.group, why, self.stats.orphans,
        )  # fmt: skip
        spec = GroupSpec(request.method, max(request.n, 1), seed, request.order)
        return Placement(request.group, spec, 0, fresh=True)

    def _derived_seed(self, group: str) -> int:
        if group not in self._derived:
            self._derived[group] = self._next_counter_seed()
            while len(self._derived) > self.max_open_groups:
                self._derived.popitem(last=False)
        return self._derived[group]

    def _next_counter_seed(self) -> int:
        self._counter += 1
        engine_seed = seed_to_u64(self.salt.engine_seed)
        return counter_seed(engine_seed, Purpose.ENGINE_GROUP_SEED, self.salt.dp_rank, self._counter)

    def _salted(self, seed: int) -> int:
        # Rank 0 keeps the user's seed as it is, so a single engine reproduces
        # the same groups as before data parallelism.
        return seed if self.salt.dp_rank == 0 else stable_seed("dp", seed, self.salt.dp_rank)


@dataclass
class _AutoGroup:
    """One open auto group: its seed, its next member index, its members in the batch, idle since when."""

    seed: int
    next_member: int = 0
    live: int = 0
    idle_since: float = 0.0


def _log_counted(message: str, *args: object) -> None:
    """A warning for a counted event, logged at its 1st, 2nd, 4th, 8th, … occurrence (the count is
    the last argument): said, never a flood."""
    count = int(args[-1])  # type: ignore[call-overload]
    if count & (count - 1) == 0:
        logger.warning(message, *args)
