"""qmc-sampler's ``vllm.general_plugins`` entry point: what the plugin adds to every vLLM process.

vLLM calls :func:`register` in each process it starts (front-end, engine core,
workers) before building an engine; it is idempotent. It

1. wraps vLLM's samplers so that *processed* logprobs of imposed rows stay the
   model's own (:mod:`qmc_sampler.vllm_plugin.logprobs`, version-checked); and
2. gives vLLM's workers a ``qmc_sampler_stats`` method, so that a server or an
   evaluation run can ask every worker whether it runs the processor
   (``collective_rpc("qmc_sampler_stats")``; see :mod:`.checks`).

``VLLM_PLUGINS`` (vLLM's allow-list of plugin names) must include
``qmc_sampler`` where it is set.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register"]


def register() -> None:
    """Install the logprobs wrap and the workers' stats method (idempotent)."""
    from qmc_sampler.vllm_plugin.logprobs import install

    install()
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, "qmc_sampler_stats"):
        WorkerBase.qmc_sampler_stats = _worker_stats  # type: ignore[attr-defined]


def _worker_stats(worker: Any) -> dict[str, Any]:
    from qmc_sampler.vllm_plugin.processor import plugin_stats

    return plugin_stats(worker)
