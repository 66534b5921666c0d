"""Correct *processed* logprobs for rows the plugin imposed a token on.

vLLM computes ``processed_logprobs`` / ``processed_logits`` after the logits
processors (V1: inside ``TopKTopPSampler``, after the argmax-invariant
processors, ``vllm/v1/sample/sampler.py::Sampler.sample``; Model Runner V2:
after custom processors, temperature, min-p and top-k/top-p,
``vllm/v1/worker/gpu/sample/sampler.py::Sampler.sample``). The plugin imposes
its choice by setting every other logit of the row to ``-inf``, so without
this module every sampled token would report logprob 0 in those modes — and
TRL's importance-sampling correction, which divides by vLLM's probability of
the sampled token, would be silently wrong. (The default ``raw_*`` modes are
computed before any processor and need nothing.)

The fix has two halves:

1. the processor keeps a copy of each imposed row as it received it
   (:class:`Capture`; V1: after temperature and min-p; MRV2: before them);
2. :func:`install` wraps vLLM's ``Sampler.sample`` (V1 and MRV2) so that,
   after vLLM computed its processed logits, the captured rows are replaced by
   what vLLM would have computed without the plugin: V1 runs vLLM's own
   ``apply_top_k_top_p`` on the captured rows; MRV2 applies temperature, min-p,
   top-k and top-p with :func:`qmc_sampler.processing.process_logits` (vLLM's
   semantics, tested against vLLM's own code).

:func:`install` is registered as a ``vllm.general_plugins`` entry point, so
vLLM runs it in every process it starts. It is version-checked: on a vLLM it
was not written for it patches nothing and logs an error, and a processor in
an engine whose ``logprobs_mode`` is processed then refuses to start (loud, not
wrong numbers).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PROCESSED_MODES", "SUPPORTED_VLLM", "Capture", "install", "installed", "require_for"]

logger = logging.getLogger("vllm.qmc_sampler")

PROCESSED_MODES = ("processed_logprobs", "processed_logits")
#: vLLM versions whose samplers this module was written against (and tested on, for V1).
SUPPORTED_VLLM = ("0.32.0", "0.33.0")
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
        sampling: per row, ``(temperature, top_k, top_p, min_p)`` (MRV2 applies them itself).
    """

    rows: torch.Tensor
    logits: torch.Tensor
    sampling: list[tuple[float, int, float, float]]


def installed() -> bool:
    """True once :func:`install` has wrapped the samplers of the running vLLM."""
    return bool(_state["installed"])


def require_for(logprobs_mode: str) -> None:
    """Refuse an engine whose processed logprobs would be wrong.

    Raises:
        RuntimeError: ``logprobs_mode`` is processed and the wrap is not installed.
    """
    if logprobs_mode in PROCESSED_MODES and not installed():
        install()
    if logprobs_mode in PROCESSED_MODES and not installed():
        raise RuntimeError(
            f"qmc-sampler cannot return correct {logprobs_mode} on this vLLM ({_state['reason']}); "
            f"use --logprobs-mode raw_logprobs, or vLLM {' / '.join(SUPPORTED_VLLM)}"
        )


def install() -> None:
    """Wrap vLLM's samplers so processed logprobs stay the model's (idempotent; see module docstring)."""
    if _state["installed"]:
        return
    import vllm

    if vllm.__version__ not in SUPPORTED_VLLM:
        _refuse(f"vLLM {vllm.__version__} is not one of {SUPPORTED_VLLM}")
        return
    from vllm.v1.sample.sampler import Sampler as V1Sampler

    if list(inspect.signature(V1Sampler.sample).parameters) != _V1_SIGNATURE:
        _refuse("vllm.v1.sample.sampler.Sampler.sample has an unexpected signature")
        return
    V1Sampler.sample = _wrap_v1(V1Sampler.sample)
    try:
        from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
    except ImportError:  # pragma: no cover - depends on the installed vLLM
        V2Sampler = None
    if V2Sampler is not None:
        if list(inspect.signature(V2Sampler.sample).parameters) != _V2_SIGNATURE:
            _refuse("vllm.v1.worker.gpu.sample.sampler.Sampler.sample has an unexpected signature")
            return
        V2Sampler.sample = _wrap_v2(V2Sampler.sample)
    _state.update(installed=True, reason="installed")


def _refuse(reason: str) -> None:
    _state["reason"] = reason
    logger.error(
        "qmc-sampler: processed logprobs cannot be corrected (%s); engines with a processed logprobs_mode "
        "will refuse to start with the plugin",
        reason,
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
                t, k, p, m = (torch.tensor(v) for v in zip(*c.sampling, strict=True))
                # MRV2's sample() returns processed *logits* in both modes; compute_topk_scores
                # takes the log-softmax afterwards for processed_logprobs.
                _store(processed, c.rows.to(processed.device), process_logits(c.logits, t, k, p, m), "processed_logits")
        return sampled, processed

    return sample


def _store(processed: torch.Tensor, rows: torch.Tensor, logits: torch.Tensor, mode: str) -> None:
    value = logits if mode == "processed_logits" else logits.log_softmax(dim=-1, dtype=torch.float32)
    processed[rows] = value.to(processed.dtype)
