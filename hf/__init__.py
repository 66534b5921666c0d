"""Correlated groups in Hugging Face ``generate`` (``qmc_sampler.hf``), no vLLM needed.

* :class:`QMCGenerate` — a ``custom_generate`` callable:
  ``model.generate(..., do_sample=True, num_return_sequences=G, custom_generate=QMCGenerate("lattice"))``;
* :func:`patch_generate` — makes every sampling ``generate`` call of one model correlated
  (TRL's ``GRPOTrainer`` with ``use_vllm=False``);
* :class:`QMCForcer` — the logits processor behind both (appended after all of HF's warpers).

transformers is imported lazily; the core (``qmc_sampler``) never imports it.
"""

from qmc_sampler.hf.forcer import ForcerStats, GroupRecord, QMCForcer
from qmc_sampler.hf.generate import GenerateHandle, QMCGenerate, patch_generate

__all__ = ["ForcerStats", "GenerateHandle", "GroupRecord", "QMCForcer", "QMCGenerate", "patch_generate"]
