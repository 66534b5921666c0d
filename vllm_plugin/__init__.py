"""vLLM integration of qmc-sampler (``qmc_sampler.vllm_plugin``).

``QMCLogitsProcessor`` (:mod:`.processor`) is imported lazily so that the pure-Python
pieces — ``request_args`` (admission from ``SamplingParams``) and ``adapters`` (the runners'
rows and slots as members) — import without vLLM. The members themselves — who is which
member, the draw cycle, parking — are engine-agnostic: :mod:`qmc_sampler.members`. ``hooks`` is the
``vllm.general_plugins`` entry point and ``logprobs`` keeps processed logprobs the model's.
Where vLLM keeps what the plugin touches, and the start-up check that an engine runs it, serve
the server and qmc-eval too: :mod:`qmc_sampler.vllm_engine`.
"""

from typing import Any

__all__ = ["QMCLogitsProcessor"]


def __getattr__(name: str) -> Any:
    if name == "QMCLogitsProcessor":
        from qmc_sampler.vllm_plugin.processor import QMCLogitsProcessor

        return QMCLogitsProcessor
    raise AttributeError(name)
