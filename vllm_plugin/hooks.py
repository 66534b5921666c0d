"""qmc-sampler's ``vllm.general_plugins`` entry point: what the plugin adds to every vLLM process.

vLLM calls :func:`register` in each process it starts (front-end, engine core,
workers) before building an engine; it is idempotent. It

1. wraps vLLM's samplers so that *processed* logprobs of imposed rows stay the
   model's own (:mod:`qmc_sampler.vllm_plugin.logprobs`, shape-checked);
2. wraps the front-end's admission-time validator builder
   (``InputProcessor._build_logits_processors_params_validator``) so that
   :func:`~qmc_sampler.vllm_plugin.request_args.resolve` knows its engine's
   speculative decoding and ``logprobs_mode`` (:class:`~.request_args.EngineFacts`),
   and logs at engine start when the plugin cannot act (speculative decoding); and
3. gives vLLM's workers a ``qmc_sampler_stats`` method, so that a server or an
   evaluation run can ask every worker whether it runs the processor
   (``collective_rpc("qmc_sampler_stats")``; see :mod:`.checks`).

Nothing here changes an engine or request without a design. ``VLLM_PLUGINS``
(vLLM's allow-list of plugin names) must include ``qmc_sampler`` where it is set.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

__all__ = ["register"]

logger = logging.getLogger("vllm.qmc_sampler")


def register() -> None:
    """Install the logprobs wrap, the admission facts and the workers' stats method (idempotent)."""
    from qmc_sampler.vllm_plugin.logprobs import install

    install()
    _record_engine_facts()
    _record_request_ids()
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, "qmc_sampler_stats"):
        WorkerBase.qmc_sampler_stats = _worker_stats  # type: ignore[attr-defined]


def _worker_stats(worker: Any) -> dict[str, Any]:
    from qmc_sampler.vllm_plugin.processor import plugin_stats

    return plugin_stats(worker)


def _record_engine_facts() -> None:
    try:
        from vllm.v1.engine.input_processor import InputProcessor

        original = InputProcessor._build_logits_processors_params_validator
    except (ImportError, AttributeError) as e:
        logger.warning(
            "qmc-sampler: cannot see the engine's configuration at admission (%s); designed requests under "
            "speculative decoding or an uncorrectable processed logprobs_mode are not refused there",
            e,
        )
        return
    if getattr(original, "_qmc_wrapped", False):
        return

    @functools.wraps(original)
    def build(self: Any) -> Any:
        from qmc_sampler.vllm_plugin.request_args import ENV_METHOD, EngineFacts, engine_facts

        validate = original(self)
        facts = EngineFacts(
            speculative=getattr(self.vllm_config, "speculative_config", None) is not None,
            logprobs_mode=str(getattr(self.model_config, "logprobs_mode", "raw_logprobs")),
        )
        if facts.speculative:
            drop_in = os.environ.get(ENV_METHOD)
            logger.warning(
                "qmc-sampler: this engine runs speculative decoding, which does not run logits processors: "
                "the plugin is inactive here%s; requests that ask for a design (qmc_method) are refused",
                f" (the drop-in {ENV_METHOD}={drop_in} is ignored)" if drop_in else "",
            )

        def validator(params: Any) -> None:
            with engine_facts(facts):
                validate(params)

        return validator

    build._qmc_wrapped = True  # type: ignore[attr-defined]
    InputProcessor._build_logits_processors_params_validator = build


def _record_request_ids() -> None:
    try:
        from vllm.v1.engine.input_processor import InputProcessor

        original = InputProcessor.process_inputs
    except (ImportError, AttributeError) as e:
        logger.warning(
            "qmc-sampler: cannot see request ids at admission (%s); the prompts of a multi-prompt completion "
            "request with a design share one seed, so identical prompts in it return identical samples",
            e,
        )
        return
    if getattr(original, "_qmc_wrapped", False):
        return

    # Wrapped on the class before any engine is built: vLLM binds ``process_inputs_async`` to it
    # in ``InputProcessor.__init__``, and runs it in one thread, so the context variable holds.
    @functools.wraps(original)
    def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        from qmc_sampler.vllm_plugin.request_args import admitting

        request_id = kwargs.get("request_id", args[0] if args else None)
        with admitting(request_id if isinstance(request_id, str) else None):
            return original(self, *args, **kwargs)

    process_inputs._qmc_wrapped = True  # type: ignore[attr-defined]
    InputProcessor.process_inputs = process_inputs
