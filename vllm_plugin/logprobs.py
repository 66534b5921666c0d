"""Correct *processed* logprobs for rows the plugin imposed a token on.

The plugin imposes its choice by setting every other logit of the row to ``-inf``, so vLLM's
``processed_logprobs`` / ``processed_logits`` (:data:`PROCESSED_MODES`, TRL's) would report 0 for
every sampled token. :class:`Capture` keeps each imposed row as the processor received it;
:func:`install` (run by :mod:`.hooks` in every vLLM process) wraps vLLM's V1 and MRV2
``Sampler.sample`` so that those rows get what vLLM would have computed without the plugin —
each runner's on its own, after checking what it patches against the touch points'
table (:mod:`qmc_sampler.vllm_engine.compat`); a runner whose sampler differs is left unpatched
with an error in the log, and :func:`require_for` refuses designed requests on it under a
processed mode (:func:`installed`, :func:`reason`). Details:
docs/internals.md, "Logprobs".
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from qmc_sampler.vllm_engine import compat

__all__ = ["PROCESSED_MODES", "RUNNERS", "Capture", "install", "installed", "reason", "require_for"]

logger = logging.getLogger("vllm.qmc_sampler")

PROCESSED_MODES = ("processed_logprobs", "processed_logits")
#: The runners whose samplers are wrapped, each on its own: a mismatch in one costs only that one.
RUNNERS = ("v1", "mrv2")
_state: dict[str, tuple[bool, str]] = {runner: (False, "install() has not run") for runner in RUNNERS}
_tried: set[str] = set()


@dataclass
class Capture:
    """The rows a processor imposed on in this step, as it received them.

    Attributes:
        rows: ``[r] int64`` row indices into the step's logits.
        logits: ``[r, vocab] float32`` copies of those rows before the mask.
        sampling: ``(temperature, top_k, top_p, min_p)``, ``[r]`` each on the logits' device, as
            the requests set them (MRV2 applies them itself).
    """

    rows: torch.Tensor
    logits: torch.Tensor
    sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def installed(runner: str = "v1") -> bool:
    """True once :func:`install` has wrapped ``runner``'s sampler (``"v1"`` or ``"mrv2"``) in this vLLM."""
    return _state[runner][0]


def reason(runner: str = "v1") -> str:
    """Why ``runner``'s wrap is not installed ("installed" once it is)."""
    return _state[runner][1]


def require_for(logprobs_mode: str, runner: str = "v1") -> bool:
    """Whether designed requests on ``runner`` can get correct ``logprobs_mode`` logprobs here.

    Installs the wraps if they are not yet; logs an error (once per engine) when it cannot.
    Never raises: the engine must start for requests without a design.
    """
    if logprobs_mode not in PROCESSED_MODES:
        return True
    install()
    if not installed(runner):
        logger.error(
            "qmc-sampler: this engine returns %s, which cannot be kept correct for designed requests (%s); "
            "they are refused at admission, every other request is served as without the plugin",
            logprobs_mode,
            reason(runner),
        )
    return installed(runner)


def install() -> None:
    """Wrap each runner's sampler so processed logprobs stay the model's (idempotent; see module docstring).

    Each runner is decided on its own (:mod:`qmc_sampler.vllm_engine.compat` checks every object
    first): a changed MRV2 sampler leaves the V1 wrap in place, and the reason for the one not
    wrapped is logged once.
    """
    for runner, (touchpoints, wrap, sampler_name) in _RUNNER_TARGETS.items():
        if _state[runner][0] or runner in _tried:  # a runner that could not be wrapped is said once
            continue
        _tried.add(runner)
        try:
            for name in touchpoints:
                compat.locate(name)
            sampler, _ = compat.locate_with_owner(sampler_name)
        except compat.TouchpointError as e:
            _state[runner] = (False, str(e))
            if not _prerequisite_absent(runner):
                logger.error(
                    "qmc-sampler: processed logprobs of designed rows cannot be corrected under the %s runner (%s); "
                    "nothing of it was patched: under a processed logprobs_mode such requests are refused there",
                    runner, e,
                )  # fmt: skip
            continue
        if not getattr(sampler.sample, "_qmc_wrapped", False):  # never wrapped twice
            wrapped = wrap(sampler.sample)
            wrapped._qmc_wrapped = True  # type: ignore[attr-defined]
            sampler.sample = wrapped
        _state[runner] = (True, "installed")


def _prerequisite_absent(runner: str) -> bool:
    """True where ``runner`` runs no logits processors on this vLLM at all (MRV2 before 0.31; the V1
    runner, gone from 0.34): there is nothing to correct, and :mod:`.hooks` says at engine start what
    that means for designs."""
    return not compat.present("mrv2_processor" if runner == "mrv2" else "v1_processor")


def _captures(processors: Any) -> list[Capture]:
    out = []
    for proc in processors:
        take = getattr(proc, "take_capture", None)
        if take is not None and (capture := take()) is not None:
            out.append(capture)
    return out


def _wrap_v1(original: Any) -> Any:
    @functools.wraps(original)
    def sample(self: Any, logits: torch.Tensor, sampling_metadata: Any, logprobs_mode_override: Any = None) -> Any:
        sampled, processed = original(self, logits, sampling_metadata, logprobs_mode_override)
        captures = _captures(sampling_metadata.logitsprocs.argmax_invariant)
        mode = logprobs_mode_override or self.logprobs_mode
        if processed is not None and mode in PROCESSED_MODES:
            from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

            for c in captures:
                rows = c.rows.to(processed.device)
                k = None if sampling_metadata.top_k is None else sampling_metadata.top_k[rows]
                p = None if sampling_metadata.top_p is None else sampling_metadata.top_p[rows]
                _store(processed, rows, apply_top_k_top_p(c.logits.clone(), k, p), mode)
        return sampled, processed

    return sample


def _wrap_v2(original: Any) -> Any:
    @functools.wraps(original)
    def sample(self: Any, logits: torch.Tensor, *args: Any, return_logprobs: bool = False) -> Any:
        sampled, processed = original(self, logits, *args, return_logprobs=return_logprobs)
        captures = _captures(self.logits_processors)
        if return_logprobs and self.logprobs_mode in PROCESSED_MODES:
            from qmc_sampler.processing import process_logits

            for c in captures:
                t, k, p, m = c.sampling
                # MRV2's sample() returns processed *logits* in both modes; compute_topk_scores
                # takes the log-softmax afterwards for processed_logprobs.
                _store(processed, c.rows.to(processed.device), process_logits(c.logits, t, k, p, m), "processed_logits")
        return sampled, processed

    return sample


def _store(processed: torch.Tensor, rows: torch.Tensor, logits: torch.Tensor, mode: str) -> None:
    value = logits if mode == "processed_logits" else logits.log_softmax(dim=-1, dtype=torch.float32)
    processed[rows] = value.to(processed.dtype)


#: runner → (touch points that must all be there, the wrapper, the touch point of the wrapped method).
_RUNNER_TARGETS = {
    "v1": (("v1_sample", "apply_top_k_top_p"), _wrap_v1, "v1_sample"),
    "mrv2": (("mrv2_processor", "mrv2_sample", "mrv2_sampler"), _wrap_v2, "mrv2_sample"),
}
