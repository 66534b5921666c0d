"""Worker-side bookkeeping: which member each batch row is, and its carried state.

vLLM tells a logits processor about rows, not requests (no request id reaches it),
and a row's sampled token can still be thrown away (a chunked-prefill step samples
and discards; ``vllm/v1/worker/gpu_model_runner.py::_bookkeeping_sync``). So:

* a draw is kept *pending* on its row and committed to the member's carry only
  when the row comes back with one more accepted token (``len(output_ids)`` in
  the V1 runner, the position in MRV2); a row that comes back with the same count
  redraws from the unchanged state;
* members get indices in their group in order of arrival (or the caller's
  ``qmc_index``); vLLM's children of one ``n > 1`` request arrive in child order,
  and any bijection gives a valid group since children are exchangeable;
* a removed row (finished or preempted — vLLM does not say which) is *parked*.
  A re-added row gets its member back, state and all, by identity: vLLM keeps a
  preempted request's worker state, so the V1 runner re-adds the very same
  output-id list (MRV2: the same params object). Where that identity is gone
  (async scheduling swaps the list on resume) the member is matched by its exact
  token history. Parked members are kept in an LRU of bounded size; a
  member that cannot be recovered continues with fresh counter-based uniforms
  (still an exact draw) and is counted in a log line.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from qmc_sampler.vllm_plugin.request_args import QMCRequest

from qmc_sampler.group import GroupSpec, MemberState, carry_member

__all__ = ["GroupRegistry", "Pending", "Row", "token_history"]

logger = logging.getLogger("vllm.qmc_sampler")

_HASH_MOD = (1 << 61) - 1


def token_history(tokens: Sequence[int]) -> int:
    """A rolling hash of a token sequence (equal sequences, equal hashes)."""
    h = 0
    for t in tokens:
        h = _extend_history(h, t)
    return h


def _extend_history(h: int, token: int) -> int:
    return (h * 1_000_003 + int(token) + 2) % _HASH_MOD


@dataclass
class Pending:
    """A draw made for a row, not yet known to be accepted by the engine."""

    uniform: float
    start: float
    prob: float
    token: int


@dataclass
class Row:
    """A request (one member) with a design, as the processor tracks it."""

    request: QMCRequest
    state: MemberState
    top_k: int
    top_p: float
    temperature: float
    min_p: float
    output_ids: list[int] | None = None  # V1: the engine's list, grows in place
    key: object = None  # what identifies the request across removal (see module docstring)
    pending: Pending | None = None
    history: int = 0  # token_history of the committed tokens

    def sync(self, accepted: int, last_token: int | None, stats: RegistryStats) -> None:
        """Reconcile with the engine's count of accepted output tokens.

        Args:
            accepted: tokens the engine has accepted for this request so far.
            last_token: the last accepted token if known (-1 / None: unknown yet).
            stats: counters for the log line on lost state.
        """
        state = self.state
        if accepted == state.step:
            self.pending = None  # last draw discarded (or none yet): redraw at this step
            return
        if accepted == state.step + 1 and self.pending is not None:
            if last_token in (None, -1) or last_token == self.pending.token:
                p = self.pending
                carry_member(state, p.uniform, p.start, p.prob)
                self.history = _extend_history(self.history, p.token)
                self.pending = None
                return
        stats.lost(self, accepted)


@dataclass
class RegistryStats:
    """Counters of unusual events, logged when they happen."""

    restored: int = 0
    lost_members: int = 0
    overflow: int = 0

    def lost(self, row: Row, accepted: int) -> None:
        self.lost_members += 1
        row.state.fresh = True
        row.state.step = accepted
        row.pending = None
        logger.warning(
            "qmc-sampler: member %d of group %s lost its carried state at step %d; it continues with "
            "fresh uniforms (still an exact sample). Lost so far: %d",
            row.state.member,
            row.request.group,
            accepted,
            self.lost_members,
        )


@dataclass
class GroupRegistry:
    """Member indices per group, and the parked members of removed rows."""

    max_groups: int = 65_536
    max_parked: int = 65_536
    next_index: OrderedDict[str, int] = field(default_factory=OrderedDict)
    parked: OrderedDict[int, Row] = field(default_factory=OrderedDict)  # LRU over all groups
    parked_by_group: dict[str, dict[int, Row]] = field(default_factory=dict)
    stats: RegistryStats = field(default_factory=RegistryStats)

    def admit(
        self,
        request: QMCRequest,
        output_ids: Sequence[int] | None,
        *,
        key: object = None,
        top_k: int,
        top_p: float,
        temperature: float,
        min_p: float,
    ) -> Row:
        """The row for a request entering the batch: its parked member, or a new one.

        Args:
            request: the request's placement (from ``extra_args``).
            output_ids: tokens it has generated so far; None where the engine does
                not say at admission (MRV2).
            key: the object that identifies the request across removal and re-adding.
        """
        done = len(output_ids) if output_ids is not None else 0
        row = self._unpark(request.group, key, output_ids)
        if row is not None:
            self.stats.restored += 1
            logger.info(
                "qmc-sampler: member %d of group %s resumed at step %d with its carried state (%d so far)",
                row.state.member,
                request.group,
                row.state.step,
                self.stats.restored,
            )
            return row
        member = request.index if request.index is not None else self._next_member(request.group)
        spec = GroupSpec(request.method, request.n, request.seed, request.order)
        state = MemberState(spec=spec, member=member)
        row = Row(request=request, state=state, top_k=top_k, top_p=top_p, temperature=temperature, min_p=min_p, key=key)
        if member >= request.n:
            # More arrivals than the group has members (e.g. children spread over
            # data-parallel engines): keep exactness, give up correlation for this one.
            self.stats.overflow += 1
            state.member = member % request.n
            state.fresh = True
            logger.warning(
                "qmc-sampler: group %s got more than n=%d members; extra member uses fresh uniforms",
                request.group,
                request.n,
            )
        if done:
            self.stats.lost(row, done)
        return row

    def park(self, row: Row) -> None:
        """Keep a removed row's member in case the request comes back (preemption)."""
        self.parked[id(row)] = row
        self.parked_by_group.setdefault(row.request.group, {})[id(row)] = row
        while len(self.parked) > self.max_parked:
            _, old = self.parked.popitem(last=False)
            self._forget(old)

    def _forget(self, row: Row) -> None:
        group = self.parked_by_group.get(row.request.group)
        if group is not None:
            group.pop(id(row), None)
            if not group:
                del self.parked_by_group[row.request.group]

    def _next_member(self, group: str) -> int:
        member = self.next_index.pop(group, 0)
        self.next_index[group] = member + 1
        while len(self.next_index) > self.max_groups:
            self.next_index.popitem(last=False)
        return member

    def _unpark(self, group: str, key: object, output_ids: Sequence[int] | None) -> Row | None:
        candidates = list(self.parked_by_group.get(group, {}).values())
        if not candidates:
            return None
        found = None
        if key is not None:
            found = next((r for r in candidates if r.key is key), None)
        # History is only a fallback for rows that already have output: a new
        # request arrives with none, and must never take a parked sibling's member.
        if found is None and output_ids:
            found = self._match_history(candidates, output_ids)
        if found is not None:
            del self.parked[id(found)]
            self._forget(found)
        return found

    @staticmethod
    def _match_history(candidates: list[Row], output_ids: Sequence[int]) -> Row | None:
        # Most specific first: a member whose state is exactly at this history, then
        # one whose pending draw is the last accepted token, then one whose pending
        # draw was discarded. Ties are siblings with equal histories: interchangeable.
        done = len(output_ids)
        full = token_history(output_ids)
        head = token_history(output_ids[:-1]) if done else None
        last = output_ids[-1] if done else None
        tiers = (
            [r for r in candidates if r.state.step == done and r.history == full and r.pending is None],
            [
                r
                for r in candidates
                if r.state.step + 1 == done and r.history == head and r.pending is not None and r.pending.token == last
            ],
            [r for r in candidates if r.state.step == done and r.history == full],
        )
        return next((tier[0] for tier in tiers if tier), None)
