"""vLLM integration of qmc-sampler (``qmc_sampler.vllm_plugin``).

``QMCLogitsProcessor`` is imported lazily so that ``request_args`` and ``members``
(pure Python) import without vLLM.
"""

from typing import Any

__all__ = ["QMCLogitsProcessor"]


def __getattr__(name: str) -> Any:
    if name == "QMCLogitsProcessor":
        from qmc_sampler.vllm_plugin.processor import QMCLogitsProcessor

        return QMCLogitsProcessor
    raise AttributeError(name)
