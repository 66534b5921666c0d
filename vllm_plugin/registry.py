"""The member registry: every request with a design, its carried state, and the draw cycle.

:class:`MemberRegistry` is where both runners' adapters meet: admission (a new :class:`Member`,
or a preempted one found again among the parked members by its token history,
:func:`token_history` / :func:`extend_history`), the draw → :class:`Pending` → commit cycle with
the members' numbers in a :class:`DevicePool` on the logits' device (a step never waits for the
device; :func:`upload`), and parking — bounded, counted and logged. How and why:
docs/internals.md, "The registry".
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from qmc_sampler.vllm_plugin.grouping import GroupResolver, Placement
from qmc_sampler.vllm_plugin.request_args import QMCRequest

from qmc_sampler.counter_rng import Purpose, counter_uniform, seed_to_u64
from qmc_sampler.designs import get_design
from qmc_sampler.group import PRECISION_FLOOR, MemberState
from qmc_sampler.inverse_cdf import Draw
from qmc_sampler.kernels import fused_draw

__all__ = [
    "DevicePool",
    "Member",
    "MemberRegistry",
    "Pending",
    "RowSampling",
    "extend_history",
    "token_history",
    "upload",
]

logger = logging.getLogger("vllm.qmc_sampler")

# The history fingerprints parked members are filed under (MemberRegistry._file): "at" a
# committed history (length, hash); "next" committed + a pending token (length, prefix hash, token).
_AT, _NEXT = "at", "next"

# Two 31-bit polynomial hashes side by side, one int64: each step's product stays below
# 2^51, so the device extends the hash in int64 arithmetic exactly as the host does.
_HASHES = ((2_147_483_647, 1_000_003), (2_147_483_629, 999_983))  # (prime modulus, multiplier)
_LOW = (1 << 31) - 1


def token_history(tokens: Sequence[int], h: int = 0) -> int:
    """A rolling hash of a token sequence, continued from ``h`` (equal sequences, equal hashes).

    Returns a value in [0, 2^62): two polynomial hashes modulo primes below 2^31, packed.
    """
    (p1, m1), (p2, m2) = _HASHES
    high, low = h >> 31, h & _LOW
    for t in tokens:
        high = (high * m1 + int(t) + 2) % p1
        low = (low * m2 + int(t) + 2) % p2
    return (high << 31) | low


def extend_history(h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`token_history` of one more token per row, on the device (``h``, ``tokens``: ``[rows] int64``)."""
    (p1, m1), (p2, m2) = _HASHES
    high = ((h >> 31) * m1 + tokens + 2) % p1
    low = ((h & _LOW) * m2 + tokens + 2) % p2
    return (high << 31) | low


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
    """One request (one member of a group) with a design.

    While the member is in the batch (``slot >= 0``) its numbers live in the registry's
    :class:`DevicePool` and ``state.code``/``width``/``fresh``, ``pending`` and ``history``
    are stale; ``state.step`` is always the host's. Parking reads the pool row back.
    """

    placement: Placement
    state: MemberState
    sampling: RowSampling
    group_key: Hashable
    identity: Hashable = None  # the adapter's name for the request (no engine objects)
    pending: Pending | None = None  # a parked member's draw still in doubt
    history: int = 0  # token_history of the committed tokens
    engine_draws: bool = False  # this step's row is left to the engine (see MemberRegistry.leave_to_engine)
    degraded: bool = False  # it has had such a row (warned once per member)
    last_step_at: float | None = None  # wall clock of its last row in a batch (its group's TTL starts there)
    slot: int = -1  # its row of the device pool while in the batch
    drew: bool = False  # in the batch: a draw is pending on the device

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
            Up to two keys, comparable with :func:`history_fingerprints` of a request's
            output: ``("at", step, history)`` for its committed history (for step 0 only
            without a pending draw, and hash-free: every empty history is the same), and
            ``("next", step + 1, history, token)`` for committed + its pending token. A
            member whose history is unknown (``history == -1``: it lost its state) has
            no non-empty history.
        """
        state, pending, history = self.state, self.pending, self.history
        keys: list[tuple] = []
        if state.step == 0:
            if pending is None:
                keys.append((_AT, 0, 0))
        elif history >= 0:
            keys.append((_AT, state.step, history))
        if pending is not None and history >= 0:
            keys.append((_NEXT, state.step + 1, history, int(pending.token)))
        return keys


def history_fingerprints(output_ids: Sequence[int]) -> tuple[tuple, tuple | None, int]:
    """What an admission looks up: ``output_ids`` as a committed history, and as committed +
    a pending token (its last one); one pass over the tokens.

    Args:
        output_ids: the request's output tokens so far (any length).

    Returns:
        ``(at, after, history)``: the ``"at"`` key of :meth:`Member.fingerprints` for this
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


@dataclass
class RegistryStats:
    """Counters of unusual events (logged when they happen, or when the device's counts are read)."""

    admitted: int = 0
    restored: int = 0
    lost: int = 0
    unsampleable: int = 0  # rows left to the engine: NaN, or no admissible token
    parked_dropped: int = 0  # parked members dropped: their group key held max_parked_per_key
    parked_evicted: int = 0  # parked members dropped: the registry held max_parked
    parked_expired: int = 0  # parked members forgotten with their auto group (TTL or eviction)
    #: ``admitted`` by the design each member draws with (what a client can check a reply's label against)
    admitted_by_design: dict[str, int] = field(default_factory=dict)


class DevicePool:
    """The numbers of the members in the batch, one row each, on the logits' device.

    Columns: ``code``, ``width``, the pending draw (``u``, ``start``, ``prob``,
    ``token``, ``ours``: drawn by us rather than left to the engine), ``fresh``,
    ``history`` (:func:`token_history` of the committed tokens), ``seen`` (the token
    the engine accepted for the row, where the host does not know it: our pending
    token, or what the runner reports on the device), per member constants
    (``carries``: a code design; ``alone``: the width below which it goes fresh), and
    event counts the host reads at parking (``lost``: the engine accepted another
    token than ours; ``left``: the engine sampled the row).
    It lives on the CPU until the first draw names the device.
    """

    FLOATS = ("code", "width", "u", "start", "prob", "alone")
    INTS = ("token", "seen", "history", "lost", "left")
    BOOLS = ("fresh", "ours", "carries")

    def __init__(self, capacity: int = 64) -> None:
        self.device = torch.device("cpu")
        self.columns: dict[str, torch.Tensor] = {}
        self._allocate(capacity)
        self.free = list(range(capacity - 1, -1, -1))

    def _allocate(self, capacity: int) -> None:
        old = self.columns
        dtypes = {**dict.fromkeys(self.FLOATS, torch.float64), **dict.fromkeys(self.INTS, torch.int64),
                  **dict.fromkeys(self.BOOLS, torch.bool)}  # fmt: skip
        self.columns = {k: torch.zeros(capacity, dtype=t, device=self.device) for k, t in dtypes.items()}
        for k, column in old.items():
            self.columns[k][: len(column)] = column

    def to(self, device: torch.device) -> None:
        """Move the pool to ``device`` (once: the first draw's)."""
        if device != self.device:
            self.device = device
            self.columns = {k: c.to(device) for k, c in self.columns.items()}

    def take(self) -> int:
        """A free row (the pool doubles when full: host work, at admission)."""
        if not self.free:
            size = len(self.columns["code"])
            self._allocate(2 * size)
            self.free = list(range(2 * size - 1, size - 1, -1))
        return self.free.pop()

    def put(self, slot: int, **values: float | int | bool) -> None:
        """Write one row's columns (admission: host to device)."""
        for k, v in values.items():
            self.columns[k][slot] = v

    def get(self, slot: int) -> dict[str, Any]:
        """Read one row back (parking and stats) in one device-to-host transfer.

        Model Runner V2 parks every member its step leaves out, so this runs per park:
        one scalar read per column would be one device sync each.

        Args:
            slot: the row.

        Returns:
            Column name → value: ``float`` for :attr:`FLOATS`, ``int`` for :attr:`INTS`,
            ``bool`` for :attr:`BOOLS` (bit-exact: floats travel as their int64 bits).
        """
        c = self.columns
        # One-element slices are views (no kernel); float64 and int64 share a width, so the
        # floats travel as their bits, and the ints (hashes up to 2^62) exactly.
        parts = [c[k][slot : slot + 1].view(torch.int64) for k in self.FLOATS]
        parts += [c[k][slot : slot + 1] for k in self.INTS]
        parts.append(torch.cat([c[k][slot : slot + 1] for k in self.BOOLS]).long())
        row = torch.cat(parts).cpu().numpy()
        floats, ints = len(self.FLOATS), len(self.FLOATS) + len(self.INTS)
        values = row[:floats].view(np.float64).tolist() + row[floats:ints].tolist()
        values += [bool(b) for b in row[ints:]]
        return dict(zip(self.FLOATS + self.INTS + self.BOOLS, values, strict=True))

    def __getattr__(self, name: str) -> torch.Tensor:
        columns = self.__dict__.get("columns", {})
        if name in columns:
            return columns[name]
        raise AttributeError(name)


@dataclass
class MemberRegistry:
    """All members of one processor: placement, parking and the draw cycle (module docstring).

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
    stats: RegistryStats = field(default_factory=RegistryStats)
    pool: DevicePool = field(default_factory=DevicePool)
    _parked: OrderedDict[int, Member] = field(default_factory=OrderedDict)  # LRU over all groups
    # Per group key, in park order (its oldest first): the per-key bound and group expiry. (A
    # plain dict: reaching its first entry scans the slots emptied at its front since its last
    # resize, about a microsecond at the default bound.)
    _parked_by_group: dict[Hashable, dict[int, Member]] = field(default_factory=dict)
    # (group key, *fingerprint) → its members as a _Bucket (id(member), park number): admission's lookup.
    _by_history: dict[tuple, _Bucket] = field(default_factory=dict)
    # (group key, *fingerprint, identity) → the same, for members parked with an identity.
    _by_identity: dict[tuple, _Bucket] = field(default_factory=dict)
    # id(member) → (its history keys, its identity): what to take out of the index when it leaves.
    _filed: dict[int, tuple[tuple[tuple, ...], Hashable]] = field(default_factory=dict)
    _parks: int = 0  # members parked so far (the park number)
    _commits: list[tuple[Member, int, bool]] = field(default_factory=list)  # (member, token or -1, we drew it)
    _go_fresh: list[Member] = field(default_factory=list)  # carry members the host saw lose their code
    _active: dict[int, Member] = field(default_factory=dict)  # pool row -> member in the batch

    def __post_init__(self) -> None:
        # An auto group that the resolver closes (its TTL ran out, or it was evicted) can have
        # no more members: its parked ones would only hold memory until the LRU drops them.
        self.resolver.on_close = self._group_closed

    # ---- admission and parking ---------------------------------------------
    def admit(
        self,
        request: QMCRequest,
        sampling: RowSampling,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        identity: Hashable = None,
        again: bool = False,
    ) -> Member:
        """The member of a request entering the batch: its parked member back, or a new one.

        Args:
            request: the request's group arguments (from ``extra_args``).
            sampling: its sampling parameters.
            prompt_ids: its prompt (auto groups are keyed by it).
            output_ids: the tokens it has generated so far (non-empty after preemption).
            identity: what names the request across removal and re-adding, if the
                adapter knows (V1: its output list's id; MRV2: its params object's id).
            again: the request ran before and its member was dropped (MRV2 knows): no parked
                member is looked for, only ``len(output_ids)`` is read, and it is placed as a
                re-admitted request (never numbered again in its group).

        Returns:
            The member, in the batch (it has a pool row).
        """
        key = self.resolver.key(request, prompt_ids)
        # The output's history is hashed once here, whatever the number of parked members.
        at, after, history = history_fingerprints(output_ids) if not again else ((), None, -1)
        member = self._unpark(key, identity, len(output_ids), at, after) if not again else None
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
                the last one, where the adapter still knows them (V1): the pending draw is
                then settled before parking, so a finished member never looks unstarted.
        """
        if accepted is not None:
            self.sync(member, accepted, last_token)
        self._deactivate(member)
        self.resolver.left(member.placement, member.last_step_at)
        if id(member) in self._parked:  # parked twice: filed again, as parked now
            self._parked.pop(id(member))
            self._forget(member)
        key = id(member)
        self._parked[key] = member
        self._parked_by_group.setdefault(member.group_key, {})[key] = member
        self._file(member)
        group = self._parked_by_group.get(member.group_key, {})
        if len(group) > self.max_parked_per_key:
            self.stats.parked_dropped += 1
            self._drop(next(iter(group.values())), self.stats.parked_dropped, "its group key held max_parked_per_key")
        while len(self._parked) > self.max_parked:
            self.stats.parked_evicted += 1
            self._drop(next(iter(self._parked.values())), self.stats.parked_evicted, "the registry held max_parked")

    def reclaim(self, member: Member) -> bool:
        """Take a parked member back into the batch as it is (its request was only not
        scheduled for a while); False if a re-admitted request took it meanwhile."""
        if self._parked.pop(id(member), None) is None:
            return False
        self._forget(member)  # out of the index: no admission may take a member in the batch
        self.resolver.joined(member.placement)
        self._activate(member)
        return True

    def parked(self) -> int:
        """How many members are parked now."""
        return len(self._parked)

    def settle(self, member: Member) -> MemberState:
        """A member in the batch, brought up to date on the host (its device row read back; a sync)."""
        if member.slot >= 0:
            self._flush()
            self._read_back(member)
        return member.state

    def record_draw(self, member: Member, pending: Pending) -> None:
        """Make ``pending`` the member's draw in doubt, as :meth:`draw` would (for a draw made elsewhere)."""
        self._flush()
        self.pool.put(member.slot, u=pending.uniform, start=pending.start, prob=pending.prob, token=pending.token,
                      seen=pending.token, ours=True)  # fmt: skip
        member.drew = True

    # ---- the draw cycle -----------------------------------------------------
    def sync(self, member: Member, accepted: int, last_token: int | None) -> None:
        """Reconcile a member with the engine's count of its accepted output tokens (no device wait).

        Args:
            accepted: tokens the engine has accepted for this request so far.
            last_token: the last accepted token if known (None or -1: not known yet).
        """
        state = member.state
        engine_drew, member.engine_draws = member.engine_draws, False
        if accepted == state.step:
            member.drew = False  # the last draw was discarded (or none made yet): redraw
            return
        if accepted == state.step + 1 and (engine_drew or member.drew):
            # Committed on the device with the next draw: carried if the token is the one we
            # drew; if the engine chose it (engine_drew), nothing is carried and a code design
            # continues with fresh uniforms (the commit sets that too). Unknown tokens are the
            # device's `seen`.
            token = -1 if last_token is None else int(last_token)
            self._commits.append((member, token, not engine_drew))
            state.step = accepted
            member.drew = False
            return
        self._lose(member, accepted)

    def sync_all(self, members: Sequence[Member], accepted: Sequence[int], last_tokens: torch.Tensor) -> None:
        """:meth:`sync` for a batch whose last tokens only the device knows (Model Runner V2).

        Args:
            accepted: per member, the engine's count of its accepted tokens.
            last_tokens: ``[len(members)] int64`` on the device, each member's last accepted token
                (meaningful where the count moved); never read by the host.
        """
        if members:
            self.pool.to(last_tokens.device)
            slots = upload(np.array([m.slot for m in members], dtype=np.int64), self.pool.device)
            self.pool.seen[slots] = last_tokens.long()
        for m, a in zip(members, accepted, strict=True):
            self.sync(m, a, None)

    def draw(
        self,
        logits: torch.Tensor,
        members: Sequence[Member],
        temperature: torch.Tensor,
        top_k: torch.Tensor | None,
        top_p: torch.Tensor | None,
        min_p: torch.Tensor | None,
        slots: torch.Tensor,
    ) -> Draw:
        """Each member's token for its row of ``logits`` (``[len(members), vocab]``), kept pending.

        Nothing here waits for the device: the accepted draws of the last step are carried
        and the uniforms chosen on it (the host supplies only the counter-based ones).

        Args:
            temperature, top_k, top_p, min_p: ``[len(members)]`` on the device (None: off).
            slots: ``[len(members)] int64``, each member's pool row, on the device.

        Returns:
            The :class:`~qmc_sampler.inverse_cdf.Draw`; a token of -1 marks a row the
            kernel could not draw from (NaN, nothing admissible): the engine samples it.
        """
        device = logits.device
        self.pool.to(device)
        self._flush()
        designed, fresh = self._host_uniforms(members)
        pool = self.pool
        u = torch.where(
            pool.fresh[slots], upload(fresh, device), torch.where(pool.carries[slots], pool.code[slots],
                                                                   upload(designed, device)))  # fmt: skip
        orders = {m.state.spec.order for m in members}
        if len(orders) == 1:
            draw = fused_draw(logits, u, temperature, top_k, top_p, min_p, orders.pop(), check=False)
        else:
            draw = self._draw_by_order(logits, members, u, temperature, top_k, top_p, min_p)
        pool.u[slots], pool.start[slots], pool.prob[slots] = u, draw.starts, draw.probs
        pool.token[slots], pool.ours[slots] = draw.tokens, draw.tokens >= 0
        pool.seen[slots] = draw.tokens  # the engine takes our token (the runner may say otherwise)
        now = self.resolver.clock()
        for m in members:
            m.drew = True
            m.last_step_at = now
        return draw

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
            m.drew = False
            m.engine_draws = True
            m.last_step_at = now
            self._warn_degraded(m, why)

    def counters(self) -> RegistryStats:
        """:attr:`stats` with the device's counts of the members in the batch folded in (one sync)."""
        self._flush()
        if self._active:
            slots = list(self._active)
            index = upload(np.array(slots, dtype=np.int64), self.pool.device)
            counts = torch.stack([self.pool.lost[index], self.pool.left[index]]).cpu().tolist()
            for slot, lost, left in zip(slots, *counts, strict=True):
                self._fold_events(slot, self._active[slot], lost, left)
        return self.stats

    # ---- internals ----------------------------------------------------------
    def _host_uniforms(self, members: Sequence[Member]) -> tuple[np.ndarray, np.ndarray]:
        """Per member: its per-step design's u for this step, and its fresh counter uniform (host math)."""
        count = len(members)
        seeds = np.array([seed_to_u64(m.state.spec.seed) for m in members], dtype=np.uint64)
        indices = np.array([m.state.member for m in members], dtype=np.int64)
        steps = np.array([m.state.step for m in members], dtype=np.int64)
        fresh = counter_uniform(seeds, Purpose.FRESH, indices, steps)
        designed = np.zeros(count, dtype=np.float64)
        by_method: dict[str, list[int]] = {}
        for j, m in enumerate(members):
            by_method.setdefault(m.state.spec.method, []).append(j)
        for method, rows in by_method.items():
            design = get_design(method)
            if not design.carries:
                ns = np.array([members[j].state.spec.n for j in rows], dtype=np.int64)
                designed[rows] = design.step_uniforms(seeds[rows], ns, indices[rows], steps[rows])
        return designed, fresh

    def _draw_by_order(self, logits, members, u, temperature, top_k, top_p, min_p) -> Draw:  # type: ignore[no-untyped-def]
        tokens = torch.empty(len(members), dtype=torch.int64, device=logits.device)
        starts = torch.empty(len(members), dtype=torch.float64, device=logits.device)
        probs = torch.empty_like(starts)
        for order in {m.state.spec.order for m in members}:
            rows = upload(np.array([j for j, m in enumerate(members) if m.state.spec.order == order]), logits.device)
            k, p, mp = (None if t is None else t[rows] for t in (top_k, top_p, min_p))
            part = fused_draw(logits[rows], u[rows], temperature[rows], k, p, mp, order, check=False)
            tokens[rows], starts[rows], probs[rows] = part.tokens, part.starts, part.probs
        return Draw(tokens=tokens, starts=starts, probs=probs)

    def _flush(self) -> None:
        """Carry the accepted draws and apply the host's fresh switches, on the device."""
        pool = self.pool
        if self._go_fresh:
            slots = upload(np.array([m.slot for m in self._go_fresh], dtype=np.int64), pool.device)
            pool.fresh[slots] = pool.carries[slots] | pool.fresh[slots]
            self._go_fresh = []
        commits, self._commits = self._commits, []
        while commits:
            # A member committed twice between draws (a step left to the engine draws nothing)
            # is carried in rounds: one scatter must not hold one pool row twice.
            now, later, rows = [], [], set()
            for commit in commits:
                (later if commit[0].slot in rows else now).append(commit)
                rows.add(commit[0].slot)
            self._carry(now)
            commits = later

    def _carry(self, commits: list[tuple[Member, int, bool]]) -> None:
        """One round of :meth:`_flush`: commits of distinct members."""
        pool = self.pool
        slots = upload(np.array([m.slot for m, _, _ in commits], dtype=np.int64), pool.device)
        told = upload(np.array([t for _, t, _ in commits], dtype=np.int64), pool.device)
        drew = upload(np.array([d for _, _, d in commits], dtype=np.bool_), pool.device)
        accepted = torch.where(told >= 0, told, pool.seen[slots])
        pool.history[slots] = extend_history(pool.history[slots], accepted)
        ours, carries = drew & pool.ours[slots], pool.carries[slots]
        mine = ours & (pool.token[slots] == accepted)
        # The kernel could not draw from the row (the engine sampled it), or the engine
        # accepted another token than ours: nothing to carry, and a code design's coupling
        # is gone (fresh from now on). A row the host left to the engine is counted there.
        pool.left[slots] += (drew & ~ours).long()
        pool.lost[slots] += (ours & ~mine).long()
        fresh = pool.fresh[slots] | (carries & ~mine)
        carry = mine & carries & ~fresh
        # Rounding can push the quotient to 1.0 (or a hair below 0): the interval is half-open.
        code = ((pool.u[slots] - pool.start[slots]) / pool.prob[slots]).clamp(0.0, math.nextafter(1.0, 0.0))
        width = pool.width[slots] * pool.prob[slots]
        pool.code[slots] = torch.where(carry, code, pool.code[slots])
        pool.width[slots] = torch.where(carry, width, pool.width[slots])
        pool.fresh[slots] = fresh | (carry & (width < pool.alone[slots]))

    def _fresh_from_now(self, member: Member) -> None:
        if get_design(member.state.spec.method).carries:
            member.state.fresh = True
            if member.slot >= 0:
                self._go_fresh.append(member)

    def _activate(self, member: Member) -> None:
        """Give a member entering the batch its pool row, written from its host state."""
        state = member.state
        design = get_design(state.spec.method)
        if design.carries and state.code is None and not state.fresh:
            seeds = np.array([seed_to_u64(state.spec.seed)], dtype=np.uint64)
            state.code = float(design.start_codes(seeds, np.array([state.spec.n]), np.array([state.member]))[0])
        alone = max(float(design.alone_widths(np.array([state.spec.n]))[0]), PRECISION_FLOOR)
        member.slot = self.pool.take()
        p = member.pending
        self.pool.put(
            member.slot, code=state.code or 0.0, width=state.width, fresh=state.fresh, carries=design.carries,
            alone=alone, lost=0, left=0, history=member.history, ours=p is not None, u=p.uniform if p else 0.0,
            start=p.start if p else 0.0, prob=p.prob if p else 1.0, token=p.token if p else -1,
            seen=p.token if p else -1,
        )  # fmt: skip
        member.drew = p is not None
        member.pending = None
        self._active[member.slot] = member

    def _deactivate(self, member: Member) -> None:
        """Read a member's pool row back into its host state and free the row."""
        if member.slot < 0:
            return
        self._flush()
        self._read_back(member)
        del self._active[member.slot]
        self.pool.free.append(member.slot)
        member.slot = -1

    def _read_back(self, member: Member) -> None:
        row = self.pool.get(member.slot)
        state = member.state
        if get_design(state.spec.method).carries and not row["fresh"]:
            state.code, state.width = row["code"], row["width"]
        state.fresh = bool(row["fresh"])
        member.history = int(row["history"])
        # A draw in doubt; none where the engine sampled the row itself (it has no interval of ours).
        drew = member.drew and bool(row["ours"])
        member.pending = Pending(row["u"], row["start"], row["prob"], int(row["token"])) if drew else None
        self._fold_events(member.slot, member, row["lost"], row["left"])

    def _fold_events(self, slot: int, member: Member | None, lost: int, left: int) -> None:
        """Add a pool row's event counts (read back by the caller) to :attr:`stats`, and zero them."""
        if not (lost or left):
            return
        self.pool.put(slot, lost=0, left=0)
        self.stats.lost += lost
        self.stats.unsampleable += left
        if member is not None and lost:
            logger.warning(
                "qmc-sampler: member %d of group %s: the engine accepted another token than the one drawn %d "
                "time(s); it continues with fresh uniforms (still an exact sample). Lost so far: %d",
                member.placement.member, member.placement.label, lost, self.stats.lost,
            )  # fmt: skip
        if member is not None and left:
            self._warn_degraded(member, "its logits are NaN or all -inf")

    def _warn_degraded(self, m: Member, why: str) -> None:
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

    def _lose(self, member: Member, accepted: int) -> None:
        self.stats.lost += 1
        state = member.state
        # Per-step designs carry nothing, so nothing is lost: their member index
        # still gives them their own uniforms at every step.
        self._fresh_from_now(member)
        state.step = accepted
        member.pending = None
        member.drew = False
        member.history = -1  # the tokens it skipped are unknown here: never matched by history again
        if member.slot >= 0:
            self._flush()
            self.pool.put(member.slot, history=-1)
        logger.warning(
            "qmc-sampler: member %d of group %s lost its carried state at step %d; it continues with "
            "fresh uniforms (still an exact sample). Lost so far: %d",
            member.placement.member,
            member.placement.label,
            accepted,
            self.stats.lost,
        )

    def _unpark(self, key: Hashable, identity: Hashable, done: int, at: tuple, after: tuple | None) -> Member | None:
        """Take out of parking the member a request entering the batch resumes, if any.

        The rule, over the key's parked members :meth:`Member.consistent_with` the request's
        output in the order they were parked: the first with the request's identity; else,
        for a request with a history, the first exactly at it, else the first whose pending
        token completes it. Here: at most four dictionary lookups, whatever the count parked.

        Args:
            key: the request's group key; identity: see :meth:`admit`; done: its output length;
            at, after: :func:`history_fingerprints` of its output.
        """
        found = None
        if identity is not None:
            found = self._first_parked((key, *at), identity, (key, *after) if after else None)
        # Matching by history alone needs a history: a new request arrives with
        # none, and must never take a parked sibling's member.
        if found is None and done:
            # Most specific first: a member exactly at this history, then one whose
            # pending draw is the last accepted token.
            found = self._first_parked((key, *at)) or (self._first_parked((key, *after)) if after else None)
        if found is not None:
            del self._parked[id(found)]
            self._forget(found)
        return found

    def _first_parked(self, first: tuple, identity: Hashable = None, second: tuple | None = None) -> Member | None:
        """The earliest parked member filed under one of two index keys.

        Args:
            first, second: ``(group key, *fingerprint)`` keys (``second`` may be None).
            identity: if not None, only members parked with this identity.

        Returns:
            The member parked first among those filed there, or None (it stays parked).
        """
        best: tuple[int, int] | None = None  # (park number, id)
        for history in (first, second):
            if history is None:
                continue
            bucket = self._by_history.get(history) if identity is None else self._by_identity.get((*history, identity))
            if bucket is not None:
                ident, number = _first(bucket)  # park order: the first is the earliest
                if best is None or number < best[0]:
                    best = (number, ident)
        # Every filed member is parked (filing and _forget go together); a miss is no member.
        return None if best is None else self._parked.get(best[1])

    def _file(self, member: Member) -> None:
        """Index a member being parked under its group key and the histories it matches."""
        self._parks += 1
        histories = tuple((member.group_key, *fp) for fp in member.fingerprints())
        for k in histories:
            _add(self._by_history, k, id(member), self._parks)
            if member.identity is not None:
                _add(self._by_identity, (*k, member.identity), id(member), self._parks)
        self._filed[id(member)] = (histories, member.identity)

    def _forget(self, member: Member) -> None:
        """Take a member that is leaving parking (already out of ``_parked``) out of the index."""
        group = self._parked_by_group.get(member.group_key)
        if group is not None:
            group.pop(id(member), None)
            if not group:
                del self._parked_by_group[member.group_key]
        histories, identity = self._filed.pop(id(member), ((), None))
        for k in histories:
            _remove(self._by_history, k, id(member))
            if identity is not None:
                _remove(self._by_identity, (*k, identity), id(member))

    def _drop(self, member: Member, count: int, why: str) -> None:
        """Drop a parked member to keep a bound; ``count``: that bound's drops so far (logged)."""
        del self._parked[id(member)]
        self._forget(member)
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, …: loud, not a line per park
            logger.warning(
                "qmc-sampler: dropped parked member %d of group %s at step %d: %s. If its request was "
                "preempted it continues with fresh uniforms (still an exact sample). Dropped so far: %d",
                member.placement.member, member.placement.label, member.state.step, why, count,
            )  # fmt: skip

    def _group_closed(self, key: Hashable, why: str) -> None:
        """Forget the parked members of an auto group the resolver closed (``why``: expired or evicted)."""
        members = [m for m in self._parked_by_group.get(key, {}).values() if m.placement.auto_key == key]
        if not members:
            return
        for member in members:
            del self._parked[id(member)]
            self._forget(member)
        self.stats.parked_expired += len(members)
        logger.info(
            "qmc-sampler: auto group %s %s: forgot its %d parked member(s) (a preempted one that comes back "
            "continues with fresh uniforms). Forgotten so far: %d",
            members[0].placement.label, why, len(members), self.stats.parked_expired,
        )  # fmt: skip


# The parked members filed under one key of the index, in park order, as (id(member), park
# number): most histories are one member's, kept as that pair (a few dozen bytes, not a
# dictionary's hundreds, for up to max_parked members); two or more, as an OrderedDict, whose
# first entry stays O(1) to reach however many were taken from its front before.
_Bucket = tuple[int, int] | OrderedDict[int, int]


def _add(index: dict[tuple, _Bucket], key: tuple, ident: int, number: int) -> None:
    """File member ``ident`` (parked as number ``number``, the highest so far) under ``key``."""
    bucket = index.get(key)
    if bucket is None:
        index[key] = (ident, number)
    elif isinstance(bucket, tuple):
        index[key] = OrderedDict((bucket, (ident, number)))
    else:
        bucket[ident] = number


def _first(bucket: _Bucket) -> tuple[int, int]:
    """The ``(id, park number)`` of the earliest parked member in ``bucket``."""
    return bucket if isinstance(bucket, tuple) else next(iter(bucket.items()))


def _remove(index: dict[tuple, _Bucket], key: tuple, ident: int) -> None:
    """Take member ``ident`` out of ``key``'s bucket (dropping the bucket once empty)."""
    bucket = index.get(key)
    if isinstance(bucket, tuple):
        if bucket[0] == ident:
            del index[key]
    elif bucket is not None:
        bucket.pop(ident, None)
        if not bucket:
            del index[key]


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host values on ``device`` without waiting: through pinned memory, copied asynchronously
    (torch's pinned-memory allocator keeps the block until the copy is done)."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
