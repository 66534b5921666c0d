"""The draw → pending → commit cycle of the members in the batch, their numbers on the device.

:class:`DrawCycle` keeps each member in the batch in one row of a
:class:`~qmc_sampler.members.pool.DevicePool` on the logits' device. A step:

1. :meth:`DrawCycle.draw` carries the accepted draws of the last step (on the device), picks each
   member's uniform — the carried code, its per-step design's u, or a fresh counter-based
   uniform (the host supplies only those that depend on (seed, member, step)) — and draws by
   inverse CDF; the draw is kept *pending* in the pool;
2. :meth:`DrawCycle.sync` hears the engine's count of accepted tokens: one more commits the
   pending draw (carried at the next flush, :func:`qmc_sampler.group.carry_codes`), none
   discards it (the member redraws from its unchanged state), anything else loses the carried
   state (fresh uniforms from now on: still an exact sample).

Nothing waits for the device; a pool row is read back only when its member leaves the batch
(:meth:`DrawCycle._deactivate`) or when asked (:meth:`DrawCycle.settle`, :meth:`DrawCycle.counters`).
Admission and parking: :class:`~qmc_sampler.members.registry.MemberRegistry`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from qmc_sampler.counter_rng import Purpose, counter_uniform, seed_to_u64
from qmc_sampler.designs import get_design
from qmc_sampler.group import MemberState, alone_width, carry_codes
from qmc_sampler.inverse_cdf import Draw
from qmc_sampler.kernels import draw_by_order, upload
from qmc_sampler.members.history import extend_history
from qmc_sampler.members.member import Member, Pending
from qmc_sampler.members.pool import DevicePool

__all__ = ["DrawCycle", "RegistryStats"]

logger = logging.getLogger("vllm.qmc_sampler")


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


@dataclass(kw_only=True)  # (a subclass's fields follow: keywords only, whatever the order)
class DrawCycle:
    """The members in the batch, their rows of :attr:`pool`, and the draw cycle (module docstring).

    Attributes:
        stats: counters of unusual events.
        pool: the members' numbers, on the logits' device once the first draw names it.
    """

    stats: RegistryStats = field(default_factory=RegistryStats)
    pool: DevicePool = field(default_factory=DevicePool)
    _commits: list[tuple[Member, int, bool]] = field(default_factory=list)  # (member, token or -1, we drew it)
    _go_fresh: list[Member] = field(default_factory=list)  # carry members the host saw lose their code
    _active: dict[int, Member] = field(default_factory=dict)  # pool row -> member in the batch

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
                      accepted_token=pending.token, drawn_by_us=True)  # fmt: skip
        member.draw_pending = True

    def sync(self, member: Member, accepted: int, last_token: int | None) -> None:
        """Reconcile a member with the engine's count of its accepted output tokens (no device wait).

        Args:
            accepted: tokens the engine has accepted for this request so far.
            last_token: the last accepted token if known (None or -1: not known yet).
        """
        state = member.state
        left_to_engine, member.left_to_engine = member.left_to_engine, False
        if accepted == state.step:
            member.draw_pending = False  # the last draw was discarded (or none made yet): redraw
            return
        if accepted == state.step + 1 and (left_to_engine or member.draw_pending):
            # Committed on the device with the next draw: carried if the token is the one we
            # drew; if the engine chose it (left_to_engine), nothing is carried and a code design
            # continues with fresh uniforms (the commit sets that too). Unknown tokens are the
            # device's `accepted_token`.
            token = -1 if last_token is None else int(last_token)
            self._commits.append((member, token, not left_to_engine))
            state.step = accepted
            member.draw_pending = False
            return
        self._lose(member, accepted)

    def sync_all(self, members: Sequence[Member], accepted: Sequence[int], last_tokens: torch.Tensor) -> None:
        """:meth:`sync` for a batch whose last tokens only the device knows (an engine that keeps
        them there, as vLLM's Model Runner V2 does).

        Args:
            accepted: per member, the engine's count of its accepted tokens.
            last_tokens: ``[len(members)] int64`` on the device, each member's last accepted token
                (meaningful where the count moved); never read by the host.
        """
        if members:
            self.pool.to(last_tokens.device)
            slots = upload(np.array([m.slot for m in members], dtype=np.int64), self.pool.device)
            self.pool.accepted_token[slots] = last_tokens.long()
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
        orders = [m.state.spec.order for m in members]
        draw = draw_by_order(logits, orders, u, temperature, top_k, top_p, min_p, check=False)
        pool.u[slots], pool.start[slots], pool.prob[slots] = u, draw.starts, draw.probs
        pool.token[slots], pool.drawn_by_us[slots] = draw.tokens, draw.tokens >= 0
        pool.accepted_token[slots] = draw.tokens  # the engine takes our token (sync_all may say otherwise)
        now = self._now()
        for m in members:
            m.draw_pending = True
            m.last_step_at = now
        return draw

    def leave_to_engine(self, members: Sequence[Member], why: str) -> None:
        """Let the engine sample these members' rows itself this step (a row the inverse CDF cannot
        draw from: NaN logits, or every token masked by the request's own constraints).

        The request then gets exactly what the engine gives it without qmc-sampler, instead of an
        exception inside the engine step (which would take the engine down for every user).
        Each member warns once; :attr:`RegistryStats.unsampleable` counts every such row.
        """
        now = self._now()
        for m in members:
            self.stats.unsampleable += 1
            m.draw_pending = False
            m.left_to_engine = True
            m.last_step_at = now
            self._warn_degraded(m, why)

    def counters(self) -> RegistryStats:
        """:attr:`stats` with the device's counts of the members in the batch folded in (one sync)."""
        self._flush()
        if self._active:
            slots = list(self._active)
            index = upload(np.array(slots, dtype=np.int64), self.pool.device)
            counts = torch.stack([self.pool.overridden[index], self.pool.engine_sampled[index]]).cpu().tolist()
            for slot, overridden, engine_sampled in zip(slots, *counts, strict=True):
                self._fold_events(slot, self._active[slot], overridden, engine_sampled)
        return self.stats

    # ---- internals ----------------------------------------------------------
    def _now(self) -> float:
        """The wall clock a member's last step is stamped with (seconds)."""
        return time.time()

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
        accepted = torch.where(told >= 0, told, pool.accepted_token[slots])
        pool.history[slots] = extend_history(pool.history[slots], accepted)
        ours, carries = drew & pool.drawn_by_us[slots], pool.carries[slots]
        mine = ours & (pool.token[slots] == accepted)
        # The kernel could not draw from the row (the engine sampled it), or the engine
        # accepted another token than ours: nothing to carry, and a code design's coupling
        # is gone (fresh from now on). A row the host left to the engine is counted there.
        pool.engine_sampled[slots] += (drew & ~ours).long()
        pool.overridden[slots] += (ours & ~mine).long()
        fresh = pool.fresh[slots] | (carries & ~mine)
        carry = mine & carries & ~fresh
        code, width, alone = carry_codes(
            pool.u[slots], pool.start[slots], pool.prob[slots], pool.width[slots], pool.alone[slots]
        )
        pool.code[slots] = torch.where(carry, code, pool.code[slots])
        pool.width[slots] = torch.where(carry, width, pool.width[slots])
        pool.fresh[slots] = fresh | (carry & alone)

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
        alone = alone_width(state.spec)
        member.slot = self.pool.take()
        p = member.pending
        self.pool.put(
            member.slot, code=state.code or 0.0, width=state.width, fresh=state.fresh, carries=design.carries,
            alone=alone, overridden=0, engine_sampled=0, history=member.history, drawn_by_us=p is not None,
            u=p.uniform if p else 0.0, start=p.start if p else 0.0, prob=p.prob if p else 1.0,
            token=p.token if p else -1, accepted_token=p.token if p else -1,
        )  # fmt: skip
        member.draw_pending = p is not None
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
        drew = member.draw_pending and bool(row["drawn_by_us"])
        member.pending = Pending(row["u"], row["start"], row["prob"], int(row["token"])) if drew else None
        self._fold_events(member.slot, member, row["overridden"], row["engine_sampled"])

    def _fold_events(self, slot: int, member: Member | None, overridden: int, engine_sampled: int) -> None:
        """Add a pool row's event counts (read back by the caller) to :attr:`stats`, and zero them."""
        if not (overridden or engine_sampled):
            return
        self.pool.put(slot, overridden=0, engine_sampled=0)
        self.stats.lost += overridden
        self.stats.unsampleable += engine_sampled
        if member is not None and overridden:
            logger.warning(
                "qmc-sampler: member %d of group %s: the engine accepted another token than the one drawn %d "
                "time(s); it continues with fresh uniforms (still an exact sample). Lost so far: %d",
                member.placement.member, member.placement.label, overridden, self.stats.lost,
            )  # fmt: skip
        if member is not None and engine_sampled:
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
        member.draw_pending = False
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
