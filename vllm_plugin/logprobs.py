"""Correct *processed* logprobs for rows the plugin imposed a token on.

The plugin imposes its choice by setting every other logit of the row to ``-inf``, so vLLM's
``processed_logprobs`` / ``processed_logits`` (:data:`PROCESSED_MODES`, TRL's) would report 0 for
every sampled token. :class:`Capture` keeps each imposed row as the processor received it;
:func:`install` (run by :mod:`.hooks` in every vLLM process) wraps vLLM's V1 and MRV2
``Sampler.sample`` so that those rows get what vLLM would have computed without the plugin —
after checking the shape of everything it patches; otherwise it patches nothing, logs an error,
and :func:`require_for` refuses designed requests under a processed mode (:func:`installed`,
:func:`reason`). Details: docs/internals.md, "Logprobs".
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PROCESSED_MODES", "Capture", "install", "installed", "reason", "require_for"]

logger = logging.getLogger("vllm.qmc_sampler")

PROCESSED_MODES = ("processed_logprobs", "processed_logits")
_V1_SIGNATURE = ["self", "logits", "sampling_metadata", "logprobs_mode_override"]
_V2_SIGNATURE = [
    "self",
    "logits",
    "expanded_idx_mapping",
    "idx_mapping",
    "idx_mapping_np",
    "pos",
    "input_ids",
    "expanded_local_pos",
    "seq_lens_upper_bound_np",
    "return_logprobs",
]
_state: dict[str, Any] = {"installed": False, "reason": "install() has not run"}


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


def installed() -> bool:
    """True once :func:`install` has wrapped the samplers of the running vLLM."""
    return bool(_state["installed"])


def reason() -> str:
    """Why the wrap is not installed ("installed" once it is)."""
    return str(_state["reason"])


def require_for(logprobs_mode: str) -> bool:
    """Whether designed requests can get correct ``logprobs_mode`` logprobs in this process.

    Installs the wrap if it is not yet; logs an error (once per engine) when it cannot.
    Never raises: the engine must start for requests without a design.
    """
    if logprobs_mode not in PROCESSED_MODES:
        return True
    install()
    if not installed():
        logger.error(
            "qmc-sampler: this engine returns %s, which cannot be kept correct for designed requests (%s); "
            "they are refused at admission, every other request is served as without the plugin",
            logprobs_mode,
            reason(),
        )
    return installed()


def install() -> None:
    """Wrap vLLM's samplers so processed logprobs stay the model's (idempotent; see module docstring)."""
    if _state["installed"]:
        return
    targets, why = _patch_targets()
    if targets is None:
        _refuse(why)
        return
    for sampler, wrap in targets:
        if not getattr(sampler.sample, "_qmc_wrapped", False):  # never wrapped twice
            wrapped = wrap(sampler.sample)
            wrapped._qmc_wrapped = True  # type: ignore[attr-defined]
            sampler.sample = wrapped
    _state.update(installed=True, reason="installed")


def _patch_targets() -> tuple[list[tuple[Any, Any]] | None, str]:
    """Every (class, wrapper) to patch, or None and why not: all checked before any is patched."""
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
        from vllm.v1.sample.sampler import Sampler as V1Sampler
    except ImportError as e:
        return None, f"vLLM's V1 sampler cannot be imported ({e})"
    if not callable(apply_top_k_top_p):
        return None, "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p is not a function"
    if _parameters(V1Sampler.sample) != _V1_SIGNATURE:
        return None, "vllm.v1.sample.sampler.Sampler.sample has an unexpected signature"
    targets = [(V1Sampler, _wrap_v1)]
    try:  # Model Runner V2 ships with vLLM >= 0.32; absent elsewhere.
        from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
    except ImportError:  # pragma: no cover - depends on the installed vLLM
        return targets, ""
    if _parameters(V2Sampler.sample) != _V2_SIGNATURE:
        return None, "vllm.v1.worker.gpu.sample.sampler.Sampler.sample has an unexpected signature"
    return [*targets, (V2Sampler, _wrap_v2)], ""


def _parameters(function: Any) -> list[str]:
    # A wrapped sample (ours, from an earlier install in this process) shows the original's.
    return list(inspect.signature(function).parameters)


def _refuse(why: str) -> None:
    _state["reason"] = why
    logger.error(
        "qmc-sampler: processed logprobs cannot be corrected (%s); nothing was patched. Engines start and "
        "serve as without the plugin; under a processed logprobs_mode, requests with a design are refused",
        why,
    )


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
