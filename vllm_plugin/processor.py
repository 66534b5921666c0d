"""``QMCLogitsProcessor``: correlated groups inside unmodified vLLM.

One class for both of vLLM's logits-processor interfaces — the V1 runner and Model Runner V2 —
so users pass one class path (``qmc_sampler.vllm_plugin:QMCLogitsProcessor``) whatever runner
they get. Its bases are the interfaces the running vLLM has (:mod:`qmc_sampler.vllm_engine.compat`):
nothing release-specific is imported by name, so the module imports on every vLLM, and where an
interface is not as the plugin needs it the processor steps aside (:attr:`QMCLogitsProcessor.inactive`).
It is thin: an adapter per runner (:mod:`.adapters`) turns rows or slots into members
of one :class:`~qmc_sampler.members.registry.MemberRegistry`; for each row whose request has
a design it draws the member's token from the processed distribution and sets every other logit
of the row to ``-inf``. Greedy rows and requests without a design are left untouched.
:func:`plugin_stats` reads the counters. Where it sits in each runner, and why declaring argmax
invariance is truthful: docs/internals.md, "The plugin in vLLM's two runners".

A draw that raises never reaches vLLM (it would take the engine down for every user), and is never
served under a design's name for long (:class:`DrawHealth`): a fused backend (``cpp``, ``triton``)
that fails has the same step drawn again on the pure-torch path — exact too, so nothing is left to
vLLM — and after :data:`FAILURES_IN_A_ROW` failing steps in a row it is dropped for this processor
(said once). Where the pure-torch path fails as well, the rows are left to vLLM (counted:
``draw_failed_rows``), and after as many such steps in a row the processor stops drawing: admission
then refuses designs (:func:`qmc_sampler.vllm_engine.checks.record_broken_draws`). One traceback per
backend, then counters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from qmc_sampler.vllm_engine import checks, compat
from qmc_sampler.vllm_plugin.adapters import MRV2Slots, V1Rows
from qmc_sampler.vllm_plugin.logprobs import PROCESSED_MODES, Capture, require_for
from qmc_sampler.vllm_plugin.request_args import install_prompt_marks, resolve

from qmc_sampler import kernels
from qmc_sampler.kernels import upload
from qmc_sampler.members import EngineSalt, GroupResolver, Member, MemberRegistry

if TYPE_CHECKING:
    from vllm.v1.sample.logits_processor import BatchUpdate

__all__ = ["FAILURES_IN_A_ROW", "DrawHealth", "QMCLogitsProcessor", "plugin_stats"]

logger = logging.getLogger("vllm.qmc_sampler")

# vLLM imports this class in the front end when it builds the engine's admission checks, before any
# request: the serving routes then number their prompts (request_args.mark_prompt). Idempotent.
install_prompt_marks()

#: The running vLLM's logits-processor base classes: V1's (vLLM < 0.34) and MRV2's (>= 0.31). Each
#: runner's loader accepts only subclasses of its own; a vLLM with neither gets a plain class, which
#: imports and serves nothing (a loader that checks a class at none of the table's places would refuse
#: it: ``make compat-check`` finds such a release, the "loaders" verdict of compat.check_sources).
_FOUND = list(dict.fromkeys([*compat.find_all("v1_processor"), *compat.find_all("mrv2_processor")]))
# Every name a loader may check the class against (the MRV2 loader's own import too); one class re-exported
# under two names counts once, and a base that is another's parent is implied by it.
_BASES = tuple(b for b in _FOUND if not any(o is not b and issubclass(o, b) for o in _FOUND)) or (object,)
_said: set[str] = set()

#: Steps in a row whose draw fails before the processor stops using what fails: the fused backend
#: (the pure-torch path draws from then on), or every backend (it stops drawing; designs are refused).
FAILURES_IN_A_ROW = 3
#: The variable that forces ``qmc_sampler.kernels``' backend process-wide (the processor's own fallback
#: is ``kernels.pure_torch``, for its draw alone).
_BACKEND_ENV = "QMC_SAMPLER_BACKEND"


@dataclass
class DrawHealth:
    """How one processor's draws went (its ``draw_*`` stats), and what it draws with now.

    Attributes:
        drawn: rows the plugin drew.
        failures: steps on which a draw raised (on any backend).
        failed_rows: rows left to vLLM because the draw failed on every backend: vLLM sampled them
            i.i.d., so their members' groups are not the design their requests named.
        backend: the backend of its first draw (``qmc_sampler.kernels``), None before it.
        fallback: why it draws on the pure-torch path instead, or None.
        broken: why it stopped drawing (every designed row goes to vLLM; designs are refused), or None.
        error: the last failure, ``"Type: message"``.
    """

    drawn: int = 0
    failures: int = 0
    failed_rows: int = 0
    backend: str | None = None
    fallback: str | None = None
    broken: str | None = None
    error: str | None = None
    fused_in_a_row: int = 0  # steps in a row whose fused backend failed
    all_in_a_row: int = 0  # steps in a row whose draw failed on every backend
    traced: set[str] = field(default_factory=set)  # backends whose failure was logged with its traceback
    step_failed: bool = False  # this step's failure is counted (a fused failure, then the torch path's)

    def count_failure(self) -> None:
        """Count this step in :attr:`failures`, once however many of its draws raised."""
        if not self.step_failed:
            self.step_failed = True
            self.failures += 1

    def stats(self) -> dict[str, Any]:
        """The ``draw_*`` counters of :meth:`QMCLogitsProcessor.stats`."""
        return {
            "drawn": self.drawn,
            "draw_failures": self.failures,
            "draw_failed_rows": self.failed_rows,
            "draw_backend": "torch" if self.fallback else self.backend,
            "draw_fallback": self.fallback,
            "draw_broken": self.broken,
            "draw_error": self.error,
        }


class QMCLogitsProcessor(*_BASES):  # type: ignore[misc]
    """Impose each group member's correlated, exact token choice (see module docstring).

    Attributes:
        interface: ``"v1"`` or ``"mrv2"``, the runner interface vLLM built this instance for.
        inactive: None, or why this vLLM's interface is not as the plugin needs it
            (:func:`qmc_sampler.vllm_engine.compat.runner_problem`): the processor then admits no
            request and changes no logits, and admission refuses designs in this engine's front end.
    """

    def __init__(self, vllm_config: Any, *args: Any) -> None:
        # V1: (vllm_config, device, is_pin_memory); MRV2: (vllm_config, req_states).
        self.interface = "mrv2" if len(args) == 1 else "v1"
        self.inactive = compat.runner_problem(self.interface)
        if self.inactive is not None and self.interface not in _said:
            _said.add(self.interface)
            logger.error("qmc-sampler: the plugin is inactive in this engine (%s); every request is served as "
                         "without it, and requests that ask for a design are refused", self.inactive)  # fmt: skip
        salt = EngineSalt(
            engine_seed=int(vllm_config.model_config.seed or 0),
            dp_rank=int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0),
        )
        self.registry = MemberRegistry(resolver=GroupResolver(salt=salt))
        self.v1 = V1Rows(self.registry)
        self.mrv2 = MRV2Slots(self.registry, args[0]) if self.interface == "mrv2" and not self.inactive else None
        mode = str(vllm_config.model_config.logprobs_mode)
        # Without the wrap, imposed rows would report logprob 0 in this mode: admission refuses
        # designed requests, and any that arrive anyway are left to the engine (loudly).
        correctable = require_for(mode, self.interface)
        self._wrong_logprobs = None if correctable else f"{mode} cannot be kept correct on this vLLM"
        self._capture_rows = mode in PROCESSED_MODES
        self._capture: Capture | None = None
        self._batch: _Batch | None = None
        self.health = DrawHealth()
        logger.info(
            "qmc-sampler: serving the %s logits-processor interface (logprobs_mode=%s, data-parallel rank %d)",
            "Model Runner V2" if self.interface == "mrv2" else "V1 runner",
            mode,
            salt.dp_rank,
        )

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

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """Impose the members' tokens on their rows (V1: ``apply(logits)``; MRV2: ``apply(logits, ctx)``)."""
        if self.inactive is not None:
            return logits
        if ctx is None:
            row_ids, members = self.v1.active()
        else:
            assert self.mrv2 is not None
            row_ids, members = self.mrv2.active(ctx, logits.shape[0])
        if members and self._wrong_logprobs is not None:
            self.registry.leave_to_engine(members, self._wrong_logprobs)
        elif members:
            self._impose(logits, row_ids, members, temperature_applied=ctx is None)
        return logits

    def take_capture(self) -> Capture | None:
        """The rows imposed on in this step, before the mask (for :mod:`.logprobs`); cleared on read."""
        capture, self._capture = self._capture, None
        return capture

    def stats(self) -> dict[str, Any]:
        """Counters of this processor (see :func:`plugin_stats`)."""
        reg, groups = self.registry.counters(), self.registry.resolver.stats
        return {
            "interface": self.interface,
            "inactive": self.inactive,
            "rows": len(self.v1.rows) + (len(self.mrv2.slots) if self.mrv2 is not None else 0),
            "admitted": reg.admitted,
            "admitted_by_design": dict(reg.admitted_by_design),
            "restored": reg.restored,
            "lost": reg.lost,
            "unsampleable": reg.unsampleable,
            "parked": self.registry.parked(),
            "parked_dropped": reg.parked_dropped,
            "parked_evicted": reg.parked_evicted,
            "parked_expired": reg.parked_expired,
            "overflow": groups.overflow,
            "auto_groups": groups.auto_groups,
            "auto_members": groups.auto_members,
            "auto_open": self.registry.resolver.open_auto_groups(),
            "auto_expired": groups.auto_expired,
            "auto_evicted": groups.auto_evicted,
            "arrivals_forgotten": groups.arrivals_forgotten,
            "children_forgotten": groups.children_forgotten,
            "children_lost": groups.children_lost,
            "orphans": groups.orphans,
            "children_unmarked": groups.children_unmarked,
            **self.health.stats(),
        }

    def _impose(
        self, logits: torch.Tensor, row_ids: list[int], members: list[Member], temperature_applied: bool
    ) -> None:
        # Nothing here waits for the device: the batch's index and parameter tensors are
        # rebuilt only when its members change, and rows the kernel cannot draw from (NaN,
        # nothing admissible: token -1) are left to the engine by the mask itself.
        self.health.step_failed = False
        if self.health.broken is not None:
            self._leave_undrawn(members, self.health.broken)
            checks.record_failed_draw()  # a group in flight learns it (qmc-eval's check of its groups)
            return
        try:
            batch = self._batch_tensors(row_ids, members, logits, temperature_applied)
            rows = logits if batch.whole else logits.index_select(0, batch.index)
            if self._capture_rows:
                self._capture = Capture(batch.index, rows.clone(), batch.requested)
            draw = self._draw(rows, members, batch)
        except Exception as e:  # never take the engine (every user's requests) down with one batch
            self._capture = None
            self._draw_failed(e, members)
            return
        ours = draw.tokens >= 0
        if batch.whole:
            mask = ours
        else:
            mask = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
            mask.index_copy_(0, batch.index, ours)
        tokens = draw.tokens.clamp(min=0)
        kept = logits[batch.index, tokens]
        logits.masked_fill_(mask.unsqueeze(1), float("-inf"))
        logits[batch.index, tokens] = torch.where(ours, torch.zeros_like(kept), kept)

    def _draw(self, rows: torch.Tensor, members: list[Member], batch: _Batch) -> Any:
        """The registry's draw on this processor's backend; a fused backend that raises has the same
        step drawn again on the pure-torch path (and is dropped after FAILURES_IN_A_ROW steps in a row)."""
        health = self.health

        def draw() -> Any:
            return self.registry.draw(rows, members, *batch.params, slots=batch.slots)

        if health.backend is None:
            health.backend = _backend_of(rows.device)
        if health.fallback is not None or health.backend == "torch":
            with kernels.pure_torch() if health.fallback is not None else contextlib.nullcontext():
                result = draw()
        else:
            try:
                result = draw()
                health.fused_in_a_row = 0
            except Exception as e:
                if not _raised_in_kernels(e):
                    raise  # the members' state may be half-updated: not drawn again (left to vLLM)
                self._fused_failed(e)
                # The draw raised inside the kernels, after the carry and before anything was written
                # to the pool: drawing again is the same draw, on an exact backend.
                with kernels.pure_torch():
                    result = draw()
        health.all_in_a_row = 0
        health.drawn += len(members)
        return result

    def _fused_failed(self, error: Exception) -> None:
        """Count and say a fused backend's failure (its traceback once); drop it after FAILURES_IN_A_ROW."""
        health = self.health
        health.count_failure()
        health.fused_in_a_row += 1
        health.error = f"{type(error).__name__}: {error}"[:240]  # the log holds it whole
        backend = health.backend
        if backend not in health.traced:
            health.traced.add(backend)
            logger.warning("qmc-sampler: the %s sampling backend's draw failed; the step is drawn again on the "
                           "pure-torch path (exact)\n%s", backend, _traceback(error))  # fmt: skip
        elif health.fused_in_a_row < FAILURES_IN_A_ROW and _power_of_two(health.failures):
            logger.warning("qmc-sampler: the %s sampling backend's draw failed again (%s); drawn again on the "
                           "pure-torch path. Failed draws so far: %d",
                           backend, health.error, health.failures)  # fmt: skip
        if health.fused_in_a_row >= FAILURES_IN_A_ROW:
            health.fallback = (f"the {backend} backend's draw failed {health.fused_in_a_row} steps in a row "
                               f"({health.error})")  # fmt: skip
            logger.warning("qmc-sampler: %s; this engine draws on the pure-torch path from now on (exact, slower). "
                           "Reinstall qmc-sampler or set QMC_SAMPLER_BACKEND=torch", health.fallback)  # fmt: skip

    def _draw_failed(self, error: Exception, members: list[Member]) -> None:
        """The draw failed on every backend: the rows go to vLLM (counted, recorded for the processes that
        label replies); after FAILURES_IN_A_ROW such steps in a row the processor stops drawing."""
        health = self.health
        health.count_failure()
        health.all_in_a_row += 1
        health.error = f"{type(error).__name__}: {error}"[:240]  # the log holds it whole
        if "every backend" not in health.traced:
            health.traced.add("every backend")
            logger.error("qmc-sampler: the draw failed; this step's designed rows are sampled by vLLM itself "
                         "(not by their design), counted in draw_failed_rows\n%s", _traceback(error))  # fmt: skip
        elif _power_of_two(health.failures):
            logger.error("qmc-sampler: the draw failed again (%s); rows sampled by vLLM so far: %d",
                         health.error, health.failed_rows + len(members))  # fmt: skip
        self._leave_undrawn(members, f"the draw failed ({health.error})")
        checks.record_failed_draw()
        if health.all_in_a_row >= FAILURES_IN_A_ROW:
            health.broken = f"its draw failed {health.all_in_a_row} steps in a row ({health.error})"
            weakref.finalize(self, checks.record_broken_draws(health.broken))
            logger.error("qmc-sampler: %s; this engine stops drawing: requests with a design are refused from now "
                         "on, and the designed rows of those running are sampled by vLLM (counted in "
                         "draw_failed_rows). Restart the engine", health.broken)  # fmt: skip

    def _leave_undrawn(self, members: list[Member], why: str) -> None:
        """Leave designed rows to vLLM because they could not be drawn (counted in ``draw_failed_rows``)."""
        self.health.failed_rows += len(members)
        self.registry.leave_to_engine(members, why)

    def _batch_tensors(
        self, row_ids: list[int], members: list[Member], logits: torch.Tensor, temperature_applied: bool
    ) -> _Batch:
        rows, device = logits.shape[0], logits.device
        key = (tuple(row_ids), tuple(m.slot for m in members), tuple(map(id, members)), rows, device,
               temperature_applied)  # fmt: skip
        if self._batch is None or self._batch.key != key:
            self._batch = _Batch.build(key, row_ids, members, rows, device, temperature_applied, self._capture_rows)
        return self._batch

    # ---- V1 runner ----------------------------------------------------------
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """V1: track rows (removed → parked, added → admitted or resumed, moved → re-indexed)."""
        if batch_update is not None and self.inactive is None:
            self.v1.update(batch_update)

    # ---- Model Runner V2 ----------------------------------------------------
    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        """MRV2: a request takes slot ``req_idx`` (slots are reused; no removal hook).

        Returns:
            Whether this processor may change the request's logits — True exactly for a designed request
            that samples randomly (vLLM >= 0.34 then knows its row may hold ``-inf``: ``may_mask_logits``).
        """
        if self.mrv2 is None:
            return False
        return self.mrv2.add(req_idx, sampling_params)

    def apply_staged_writes(self) -> None:
        """MRV2: admit this step's new requests, now that the runner has written their tokens."""
        if self.mrv2 is not None:
            self.mrv2.flush()


@dataclass(frozen=True)
class _Batch:
    """The tensors of one batch composition, on the device (built on the host when members change)."""

    key: tuple
    index: torch.Tensor  # [rows] the members' logits rows
    slots: torch.Tensor  # [rows] their pool rows
    whole: bool  # the rows are the whole batch, in order
    params: tuple  # temperature, top_k, top_p, min_p: [rows] each, or None (off for every row)
    requested: tuple  # temperature, top_k, top_p, min_p as each request set them: [rows] each (if captured)

    @classmethod
    def build(
        cls,
        key: tuple,
        row_ids: list[int],
        members: list[Member],
        rows: int,
        device: torch.device,
        temperature_applied: bool,
        capture: bool,
    ) -> _Batch:
        def put(values: list, dtype: type[np.generic]) -> torch.Tensor:
            # Pinned and asynchronous: Model Runner V2 reorders the rows at any step.
            return upload(np.array(values, dtype=dtype), device)

        sampling = [(m.sampling.temperature, m.sampling.top_k, m.sampling.top_p, m.sampling.min_p) for m in members]
        count = len(members)
        temperature = put([1.0] * count if temperature_applied else [t for t, *_ in sampling], np.float32)
        # A filter no row asks for is off (None), so the kernels skip it.
        top_k = put([k for _, k, _, _ in sampling], np.int64) if any(k > 0 for _, k, _, _ in sampling) else None
        top_p = put([p for _, _, p, _ in sampling], np.float32) if any(p < 1 for _, _, p, _ in sampling) else None
        min_p = None
        if not temperature_applied and any(mp > 0 for *_, mp in sampling):
            min_p = put([mp for *_, mp in sampling], np.float32)
        whole = row_ids == list(range(rows))  # every row, in order: no copy
        requested = ()
        if capture:  # processed logprobs: on the device now, not uploaded (waiting for it) in every step
            requested = (
                put([t for t, *_ in sampling], np.float32),
                put([k for _, k, _, _ in sampling], np.int64),
                put([p for _, _, p, _ in sampling], np.float32),
                put([mp for *_, mp in sampling], np.float32),
            )
        return cls(key, put(row_ids, np.int64), put([m.slot for m in members], np.int64), whole,
                   (temperature, top_k, top_p, min_p), requested)  # fmt: skip


def plugin_stats(worker: Any) -> dict[str, Any]:
    """The plugin's counters in one vLLM worker (``LLM.collective_rpc(plugin_stats)``, or the
    worker extension's ``qmc_sampler_stats``).

    Returns:
        ``{"processors": instances found, "interface": "v1" | "mrv2" | None, "inactive": why the
        plugin steps aside in this worker or None, and the sums of :meth:`QMCLogitsProcessor.stats`}``
        over the worker's processors:
        ``restored`` members resumed after preemption, ``lost`` members that continued
        with fresh uniforms, ``unsampleable`` rows left to the engine (NaN or nothing
        admissible), ``overflow`` arrivals beyond a group's n, ``auto_*`` the
        auto-grouping counters, ``arrivals_forgotten``/``children_forgotten``/``children_lost``/``orphans``
        the arrival counters forgotten and the members numbered apart, ``children_unmarked`` children
        numbered on a data-parallel rank without their place (docs/serving.md, "Who is which member"),
        ``admitted_by_design`` the members admitted by the design they draw
        with, ``rows`` members in the batch now, ``parked`` members kept for
        resumption, ``parked_dropped``/``parked_evicted``/``parked_expired`` those dropped by the
        per-key bound, the global bound, or with their auto group; the draws (:class:`DrawHealth`):
        ``drawn`` rows, ``draw_failures`` steps whose draw raised, ``draw_failed_rows`` rows vLLM
        sampled because the draw failed on every backend (also in ``unsampleable``), and the first
        processor's ``draw_backend``, ``draw_fallback``, ``draw_broken`` and ``draw_error``; ``pid``
        the worker's process (where it records failed draws: :mod:`qmc_sampler.vllm_engine.checks`).
    """
    runner = worker.model_runner
    found: list[QMCLogitsProcessor] = []
    batch = getattr(runner, "input_batch", None)
    if batch is not None and getattr(batch, "logitsprocs", None) is not None:
        found += [p for p in batch.logitsprocs.all if isinstance(p, QMCLogitsProcessor)]
    sampler = getattr(runner, "sampler", None)
    found += [p for p in getattr(sampler, "logits_processors", []) if isinstance(p, QMCLogitsProcessor)]
    totals: dict[str, Any] = {"processors": len(found), "interface": found[0].interface if found else None,
                              "pid": os.getpid()}  # fmt: skip
    totals["inactive"] = next((p.inactive for p in found if p.inactive is not None), None)
    totals["admitted_by_design"] = {}
    for proc in found:
        for key, value in proc.stats().items():
            if key == "admitted_by_design":  # {design: members}: summed design by design
                for design, count in value.items():
                    totals[key][design] = totals[key].get(design, 0) + count
            elif isinstance(value, int) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
            elif key not in ("interface", "inactive") and totals.get(key) is None:  # a word: the first one said
                totals[key] = value
    return totals


def _backend_of(device: torch.device) -> str:
    """The backend ``qmc_sampler.kernels`` draws with on ``device`` (an unavailable forced one: its name)."""
    try:
        return kernels.backend_for(device)
    except ValueError:  # QMC_SAMPLER_BACKEND names an unavailable backend: each draw raises inside kernels
        return os.environ.get(_BACKEND_ENV, "").strip() or "unknown"


def _raised_in_kernels(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ``qmc_sampler.kernels.draw_by_order`` (the backends' call)."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _DRAW_CODE:
            return True
        tb = tb.tb_next
    return False


_DRAW_CODE = kernels.draw_by_order.__code__


def _traceback(error: BaseException) -> str:
    """``error``'s traceback as text: a log record then holds no frame of the step (its logits, the
    processor), whatever handler keeps it."""
    return "".join(traceback.format_exception(error)).rstrip()


def _power_of_two(count: int) -> bool:
    return count & (count - 1) == 0
