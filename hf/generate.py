"""``QMCGenerate`` (a ``custom_generate`` callable) and ``patch_generate`` (for TRL without vLLM).

``generate(..., custom_generate=callable)`` does all of its usual preparation —
input expansion for ``num_return_sequences`` (``repeat_interleave``: row r is prompt
r // G), every logits processor and warper, stopping criteria — and then calls the
callable instead of its decoding loop (``transformers/generation/utils.py``,
``GenerationMixin.generate``). :class:`QMCGenerate` appends a
:class:`~qmc_sampler.hf.forcer.QMCForcer` to that chain and runs HF's own sampling
loop (``GenerationMixin._sample``), so everything else — caches, stopping, padding
of finished rows, ``return_dict_in_generate`` — is HF's.

Seeds: the groups of the c-th call of one :class:`QMCGenerate` are seeded from
(its seed, c, the process's ``torch.distributed`` rank), by counter-based hashes:
the same seed gives the same groups in the same sequence of calls, and two
processes never share a group seed. Without a seed, a random per-object salt.
"""

from __future__ import annotations

import functools
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
from qmc_sampler.hf.forcer import ForcerStats, GroupRecord, QMCForcer

from qmc_sampler.counter_rng import Purpose, counter_hash, seed_to_u64
from qmc_sampler.designs import METHODS
from qmc_sampler.inverse_cdf import ORDERS

__all__ = ["GenerateHandle", "QMCGenerate", "patch_generate"]

logger = logging.getLogger("qmc_sampler.hf")


class QMCGenerate:
    """Correlated groups for ``model.generate(do_sample=True, …)`` (see the module docstring).

    Args:
        method: the design, one of ``qmc_sampler.METHODS`` (``iid`` = independent draws
            through the same path).
        seed: base seed (any int); None draws a random one for this object.
        order: vocabulary order of the inverse CDF, ``"id"`` or ``"sorted"``.

    Attributes:
        stats: cumulative :class:`~qmc_sampler.hf.forcer.ForcerStats`.
        last_groups: the groups of the last call (:class:`~qmc_sampler.hf.forcer.GroupRecord`).

    Raises:
        ValueError: an unknown method or order (here); at ``generate`` time, a
            non-sampling mode (greedy, beam search, assisted or contrastive decoding).

    Example::

        out = model.generate(**inputs, do_sample=True, num_return_sequences=8, max_new_tokens=64,
                             custom_generate=QMCGenerate("lattice", seed=0))
    """

    def __init__(self, method: str = "lattice", seed: int | None = None, order: str = "id") -> None:
        if method not in METHODS:
            raise ValueError(f"method={method!r} is not a design; use one of {list(METHODS)}")
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is not a vocabulary order; use one of {list(ORDERS)}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed={seed!r} is not an int; use any Python int or None")
        self.method = method
        self.order = order
        self.seed = seed_to_u64(secrets.randbits(63) if seed is None else seed)
        self.stats = ForcerStats()
        self.last_groups: list[GroupRecord] = []

    def __call__(
        self, model: Any, input_ids: Any, logits_processor: Any, stopping_criteria: Any, generation_config: Any,
        **model_kwargs: Any,
    ) -> Any:  # fmt: skip
        """The decoding loop ``generate`` calls: HF's ``_sample`` with the forcer appended last."""
        from transformers import LogitsProcessorList

        _require_sampling(generation_config)
        forcer = QMCForcer(self.method, self._call_seed(), self.order, self.stats)
        self.stats.calls += 1
        result = model._sample(
            input_ids,
            logits_processor=LogitsProcessorList([*logits_processor, forcer]),
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            **model_kwargs,
        )
        self.last_groups = forcer.groups
        return result

    def _call_seed(self) -> int:
        rank = _process_rank()
        return int(counter_hash(self.seed, Purpose.GROUP_SEED, rank, self.stats.calls)[0] >> np.uint64(1))


def _require_sampling(generation_config: Any) -> None:
    from transformers.generation.configuration_utils import GenerationMode

    mode = generation_config.get_generation_mode()
    if mode != GenerationMode.SAMPLE:
        raise ValueError(
            f"qmc-sampler correlates sampled groups, but this generate call is {mode.value} "
            f"(do_sample={generation_config.do_sample}, num_beams={generation_config.num_beams}); use "
            "do_sample=True with num_beams=1 and no assistant, or call generate without custom_generate"
        )


def _process_rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except (ImportError, RuntimeError):
        return 0


@dataclass
class GenerateHandle:
    """What :func:`patch_generate` installed: the generator (its ``stats``, ``last_groups``) and ``restore()``."""

    model: Any
    generator: QMCGenerate
    original: Any

    def restore(self) -> None:
        """Give the model back its own ``generate``."""
        if self.model.__dict__.get("generate") is not None:
            del self.model.generate
        if self.original is not None:
            self.model.generate = self.original


def patch_generate(model: Any, method: str = "lattice", seed: int | None = None, order: str = "id") -> GenerateHandle:
    """Make every sampling ``model.generate(...)`` call produce correlated groups.

    Meant for code that calls ``generate`` itself and offers no hook, such as TRL's
    ``GRPOTrainer`` with ``use_vllm=False``: it repeats each prompt G times in a row,
    so each prompt's G rows form one group. Calls that do not sample (greedy, beam
    search) and calls that pass their own ``custom_generate`` are passed through
    unchanged (logged once).

    Args:
        model: a transformers model (patched in place, on the instance).
        method, seed, order: as :class:`QMCGenerate`.

    Returns:
        A :class:`GenerateHandle`; ``handle.restore()`` undoes the patch.

    Raises:
        ValueError: an unknown method or order, or a model already patched.
    """
    if getattr(model.generate, "_qmc_generator", None) is not None:
        raise ValueError("this model's generate is already patched by qmc-sampler; restore() the first patch")
    generator = QMCGenerate(method, seed, order)
    original = model.__dict__.get("generate")
    bound = model.generate

    @functools.wraps(bound)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("custom_generate") is None and _samples(model, kwargs):
            kwargs["custom_generate"] = generator
        else:
            _log_pass_through()
        return bound(*args, **kwargs)

    generate._qmc_generator = generator  # type: ignore[attr-defined]
    model.generate = generate
    return GenerateHandle(model, generator, original)


def _samples(model: Any, kwargs: dict[str, Any]) -> bool:
    config = kwargs.get("generation_config") or model.generation_config
    do_sample = kwargs.get("do_sample", config.do_sample)
    num_beams = kwargs.get("num_beams", config.num_beams) or 1
    assisted = kwargs.get("assistant_model") is not None or kwargs.get(
        "prompt_lookup_num_tokens", getattr(config, "prompt_lookup_num_tokens", None)
    )
    return bool(do_sample) and num_beams == 1 and not assisted


@functools.lru_cache(maxsize=1)
def _log_pass_through() -> None:
    logger.info("qmc-sampler: a generate call that does not sample (or has its own custom_generate) runs unchanged")
