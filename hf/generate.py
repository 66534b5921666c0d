"""``QMCGenerate`` (a ``custom_generate`` callable) and ``patch_generate`` (for TRL without vLLM).

``generate(..., custom_generate=callable)`` does all of its usual preparation —
input expansion for ``num_return_sequences`` (``repeat_interleave``: row r is prompt
r // G), the encoder pass of encoder-decoder models, image/video encoding, every
logits processor and warper, stopping criteria — and then calls the callable instead
of its decoding loop (``transformers/generation/utils.py``, ``GenerationMixin.generate``).
:class:`QMCGenerate` appends a :class:`~qmc_sampler.hf.forcer.QMCForcer` to that chain
and runs HF's own sampling loop (``GenerationMixin._sample``), so everything else —
caches, stopping, padding of finished rows, ``return_dict_in_generate`` — is HF's.

Groups: the prompts of a call are told apart by every per-row model input, not by
the decoder ids alone (:func:`qmc_sampler.hf.rows.prompt_keys`: encoder inputs,
attention masks, ``inputs_embeds``, images, …, hashed on the host once per call).
Each prompt's ``num_return_sequences`` copies are one group; prompts with identical
inputs given more than once (TRL's GRPO repeats each prompt G times) merge into one
group whose member indices are spread over the copies
(:func:`qmc_sampler.hf.forcer.member_order`). Rows of different prompts never share
a group. An input that cannot be split by row is warned about (once per generator
and set of inputs) and then every prompt is a group of its own copies.

What ``generate`` does not pass to a callable, :class:`QMCGenerate` recovers:
``synced_gpus`` and ``streamer`` are not forwarded to a ``custom_generate`` callable
by transformers 5 (its ``_extract_generation_mode_kwargs`` keeps only keywords that
``_sample`` does not declare), so they are read from the calling ``generate`` frame;
without an explicit value ``synced_gpus`` follows transformers' own rule (DeepSpeed
ZeRO-3 or an FSDP-managed model, and more than one process), so ZeRO-3/FSDP ranks
keep stepping together as with plain ``generate``.

Seeds: the groups of the c-th call of one :class:`QMCGenerate` are seeded from
(its seed, c, the process's ``torch.distributed`` rank), by counter-based hashes:
the same seed gives the same groups in the same sequence of calls, and two
processes never share a group seed. Without a seed, a random per-object salt.
The call number c is issued atomically, so one object may serve concurrent calls
from several threads: no two calls get the same c.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import sys
import threading
import warnings
from dataclasses import dataclass
from types import FrameType
from typing import Any

from qmc_sampler.hf.forcer import ForcerStats, GroupRecord, QMCForcer
from qmc_sampler.hf.rows import PromptKeys, prompt_keys

from qmc_sampler.counter_rng import Purpose, counter_seed, seed_to_u64
from qmc_sampler.designs import METHODS
from qmc_sampler.inverse_cdf import ORDERS
from qmc_sampler.limits import SEED_MAX, SEED_MIN, is_int

__all__ = ["GenerateHandle", "QMCGenerate", "patch_generate"]

logger = logging.getLogger("qmc_sampler.hf")

#: How many frames up transformers' ``generate`` is looked for (a wrapper or two may stand between).
_CALLER_DEPTH = 4
#: Guards every QMCGenerate's call counter and warning set (held for a few instructions).
_CALL_LOCK = threading.Lock()


class QMCGenerate:
    """Correlated groups for ``model.generate(do_sample=True, …)`` (see the module docstring).

    Args:
        method: the design, one of ``qmc_sampler.METHODS`` (``iid`` = independent draws
            through the same path).
        seed: base seed, an int in ``[SEED_MIN, SEED_MAX]`` (any 64-bit word); None draws a random
            one for this object.
        order: vocabulary order of the inverse CDF, ``"id"`` or ``"sorted"``.
        synced_gpus: default for calls that do not pass ``generate(synced_gpus=...)``:
            True or False, or None for transformers' own rule (ZeRO-3 or FSDP with
            more than one process).

    Attributes:
        stats: cumulative :class:`~qmc_sampler.hf.forcer.ForcerStats` (atomic updates; a call's
            ``unsampleable`` rows are added when it ends).
        last_groups: the groups of the last call to finish (in any thread)
            (:class:`~qmc_sampler.hf.forcer.GroupRecord`, first tokens read when the call ended).

    Raises:
        ValueError: an unknown method or order, a non-int seed or a non-bool
            ``synced_gpus`` (here); at ``generate`` time, a non-sampling mode (greedy,
            beam search, assisted or contrastive decoding).

    Example::

        out = model.generate(**inputs, do_sample=True, num_return_sequences=8, max_new_tokens=64,
                             custom_generate=QMCGenerate("lattice", seed=0))
    """

    def __init__(
        self, method: str = "lattice", seed: int | None = None, order: str = "id", synced_gpus: bool | None = None
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"method={method!r} is not a design; use one of {list(METHODS)}")
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is not a vocabulary order; use one of {list(ORDERS)}")
        if seed is not None and (not is_int(seed) or not SEED_MIN <= seed <= SEED_MAX):
            raise ValueError(f"seed={seed!r} is not a seed; use an int between {SEED_MIN} and {SEED_MAX}, or None")
        if synced_gpus is not None and not isinstance(synced_gpus, bool):
            raise ValueError(f"synced_gpus={synced_gpus!r} is not a bool; use True, False or None (transformers' rule)")
        self.method = method
        self.order = order
        self.seed = seed_to_u64(secrets.randbits(63) if seed is None else seed)
        self.synced_gpus = synced_gpus
        self.stats = ForcerStats()
        self.last_groups: list[GroupRecord] = []
        self._calls_issued = 0
        self._warned: set[tuple[str, ...]] = set()

    def __call__(
        self, model: Any, input_ids: Any, logits_processor: Any, stopping_criteria: Any, generation_config: Any,
        inputs_tensor: Any = None, synced_gpus: bool | None = None, streamer: Any = None, **model_kwargs: Any,
    ) -> Any:  # fmt: skip
        """The decoding loop ``generate`` calls: HF's ``_sample`` with the forcer appended last.

        Args:
            model: the model ``generate`` runs on.
            input_ids: ``[rows, length]`` decoder input ids (rows = prompts · num_return_sequences).
            logits_processor, stopping_criteria, generation_config: as ``generate`` prepared them.
            inputs_tensor: ``[prompts, …]`` the main input before expansion (``generate`` passes
                it because this signature declares it); used to tell prompts apart.
            synced_gpus: keep stepping until every process is done (ZeRO-3/FSDP). None: the
                value given to the calling ``generate``, else this object's ``synced_gpus``,
                else transformers' rule.
            streamer: a ``BaseStreamer``; None: the one given to the calling ``generate``.
            model_kwargs: everything else ``generate`` prepared (masks, encoder outputs, cache, …).

        Returns:
            What ``_sample`` returns (a ``[rows, length + new]`` tensor or a ``GenerateOutput``).
            The decoding steps read nothing back from the device after the first (see
            :class:`~qmc_sampler.hf.forcer.QMCForcer`); the call reads the device once at its
            end, for :attr:`stats` (``unsampleable``) and :attr:`last_groups` (first tokens).

        Raises:
            ValueError: ``generate`` is not in sampling mode.
        """
        from transformers import LogitsProcessorList

        _require_sampling(generation_config)
        caller = _generate_arguments(sys._getframe(1))
        synced = next((v for v in (synced_gpus, caller.get("synced_gpus"), self.synced_gpus) if v is not None), None)
        synced = _hf_synced_gpus(model) if synced is None else bool(synced)
        streamer = streamer if streamer is not None else caller.get("streamer")
        copies = int(generation_config.num_return_sequences or 1)
        keys = prompt_keys(input_ids, model_kwargs, inputs_tensor, copies, model, caller.get("kwargs"))
        if keys.unattributed:
            self._warn_copies_only(keys)
        forcer = QMCForcer(self.method, self._call_seed(self._issue_call()), self.order, self.stats, keys.keys,
                           keys.copies)  # fmt: skip
        self.stats.add(calls=1, copies_only_calls=int(bool(keys.unattributed)))
        extra = {} if streamer is None else {"streamer": streamer}
        try:
            result = model._sample(
                input_ids,
                logits_processor=LogitsProcessorList([*logits_processor, forcer]),
                stopping_criteria=stopping_criteria,
                generation_config=generation_config,
                synced_gpus=synced,
                **extra,
                **model_kwargs,
            )
        except BaseException:
            # HF raising on a row left to it (NaN scores): count and warn about such rows if the
            # device can still say; the loop's own error is the one raised.
            with contextlib.suppress(Exception):
                forcer.finish()
            raise
        forcer.finish()  # the call's one read of the device: rows left to HF, first tokens
        self.last_groups = forcer.groups
        return result

    def _issue_call(self) -> int:
        # Read and increment together: concurrent calls in several threads get distinct numbers.
        with _CALL_LOCK:
            call = self._calls_issued
            self._calls_issued += 1
        return call

    def _call_seed(self, call: int) -> int:
        rank = _process_rank()
        return counter_seed(self.seed, Purpose.HF_CALL_SEED, rank, call)

    def _warn_copies_only(self, keys: PromptKeys) -> None:
        names = tuple(sorted({item.split(":", 1)[0] for item in keys.unattributed}))
        with _CALL_LOCK:
            first = names not in self._warned
            self._warned.add(names)
        if first:
            warnings.warn(
                f"qmc-sampler: these model inputs cannot be split by row: {'; '.join(keys.unattributed)}. "
                f"Rows were grouped by num_return_sequences copies only: each prompt's {keys.copies} copies form "
                "one group, and a prompt given more than once (as TRL's GRPO repeats prompts) is not merged with "
                "its repeats. Every member is still an exact draw. Counted in stats.copies_only_calls; warned once "
                "per generator and set of inputs.",
                UserWarning,
                stacklevel=3,
            )


def _require_sampling(generation_config: Any) -> None:
    from transformers.generation.configuration_utils import GenerationMode

    mode = generation_config.get_generation_mode()
    if mode != GenerationMode.SAMPLE:
        raise ValueError(
            f"qmc-sampler correlates sampled groups, but this generate call is {mode.value} "
            f"(do_sample={generation_config.do_sample}, num_beams={generation_config.num_beams}); use "
            "do_sample=True with num_beams=1 and no assistant, or call generate without custom_generate"
        )


def _generate_arguments(frame: FrameType | None) -> dict[str, Any]:
    """``synced_gpus``, ``streamer`` and the model ``kwargs`` as given to transformers' ``generate``,
    if ``frame`` is its call.

    transformers 5 does not forward the first two to a ``custom_generate`` callable, and
    hands it the model inputs only after encoding them; all three are the ``generate``
    frame's own parameters, found among the nearest few callers. Empty when none is that call.
    """
    for _ in range(_CALLER_DEPTH):  # a wrapper of this callable (the custom_generate) may stand between
        if frame is None or (
            frame.f_code.co_name == "generate"
            and str(frame.f_globals.get("__name__", "")).startswith("transformers.generation")
        ):
            break
        frame = frame.f_back
    else:
        return {}
    if frame is None:
        return {}
    local = frame.f_locals
    found = {name: local.get(name) for name in ("synced_gpus", "streamer")}
    if isinstance(local.get("kwargs"), dict):
        found["kwargs"] = local["kwargs"]
    return found


def _hf_synced_gpus(model: Any) -> bool:
    """transformers' default ``synced_gpus``: ZeRO-3 or an FSDP-managed model, and more than one process."""
    import transformers.integrations.deepspeed as deepspeed

    try:
        from transformers.distributed import fsdp
    except ImportError:  # older layouts
        from transformers.integrations import fsdp  # type: ignore[no-redef]
    return bool((deepspeed.is_deepspeed_zero3_enabled() or fsdp.is_fsdp_managed_module(model)) and _world_size() > 1)


def _world_size() -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except (ImportError, RuntimeError):
        return 1


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


def patch_generate(
    model: Any, method: str = "lattice", seed: int | None = None, order: str = "id", synced_gpus: bool | None = None
) -> GenerateHandle:
    """Make every sampling ``model.generate(...)`` call produce correlated groups.

    Meant for code that calls ``generate`` itself and offers no hook, such as TRL's
    ``GRPOTrainer`` with ``use_vllm=False``: it repeats each prompt G times in a row,
    so each prompt's G rows form one group. Calls that do not sample (greedy, beam
    search) and calls that pass their own ``custom_generate`` are passed through
    unchanged (logged once).

    Args:
        model: a transformers model (patched in place, on the instance).
        method, seed, order, synced_gpus: as :class:`QMCGenerate` (a ``synced_gpus`` given to
            ``generate`` itself wins).

    Returns:
        A :class:`GenerateHandle`; ``handle.restore()`` undoes the patch.

    Raises:
        ValueError: an unknown method or order, a non-int seed, a non-bool ``synced_gpus``,
            or a model already patched.
    """
    if getattr(model.generate, "_qmc_generator", None) is not None:
        raise ValueError("this model's generate is already patched by qmc-sampler; restore() the first patch")
    generator = QMCGenerate(method, seed, order, synced_gpus)
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
