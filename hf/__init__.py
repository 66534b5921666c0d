"""Correlated groups in Hugging Face ``generate`` (``qmc_sampler.hf``), no vLLM needed.

* :class:`QMCGenerate` — a ``custom_generate`` callable:
  ``model.generate(..., do_sample=True, num_return_sequences=G, custom_generate=QMCGenerate("lattice"))``;
* :func:`patch_generate` — makes every sampling ``generate`` call of one model correlated
  (TRL's ``GRPOTrainer`` with ``use_vllm=False``);
* :class:`QMCForcer` — the logits processor behind both (appended after all of HF's warpers);
* :func:`prompt_keys` — which rows share a prompt, from every per-row model input (encoder
  inputs, ``inputs_embeds``, images), and :func:`member_order` — how a merged group's member
  indices are spread over its prompts' copies.

transformers is imported lazily; the core (``qmc_sampler``) never imports it.
"""

from qmc_sampler.hf.forcer import ForcerStats, GroupRecord, QMCForcer, member_order
from qmc_sampler.hf.generate import GenerateHandle, QMCGenerate, patch_generate
from qmc_sampler.hf.rows import PromptKeys, prompt_keys

__all__ = [
    "ForcerStats",
    "GenerateHandle",
    "GroupRecord",
    "PromptKeys",
    "QMCForcer",
    "QMCGenerate",
    "member_order",
    "patch_generate",
    "prompt_keys",
]
