"""qmc-sampler's ``vllm.general_plugins`` entry point: what the plugin adds to every vLLM process.

vLLM calls :func:`register` in each process it starts (front-end, engine core,
workers) before building an engine; it is idempotent. It

1. wraps vLLM's samplers so that *processed* logprobs of imposed rows stay the
   model's own (:mod:`qmc_sampler.vllm_plugin.logprobs`, shape-checked);
2. wraps the front-end's admission-time validator builder
   (``InputProcessor._build_logits_processors_params_validator``) so that
   :func:`~qmc_sampler.vllm_plugin.request_args.resolve` knows its engine's
   speculative decoding and ``logprobs_mode`` (:class:`~.request_args.EngineFacts`),
   and whether a worker of it stopped drawing (then designs are refused),
   and logs at engine start when the plugin cannot act (speculative decoding); and
3. gives vLLM's workers a ``qmc_sampler_stats`` method, so that a server or an
   evaluation run can ask every worker whether it runs the processor
   (``collective_rpc("qmc_sampler_stats")``; see :mod:`qmc_sampler.vllm_engine.checks`).

Nothing here changes an engine or request without a design. ``VLLM_PLUGINS``
(vLLM's allow-list of plugin names) must include ``qmc_sampler`` where it is set.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

from qmc_sampler.vllm_engine import checks, compat
from qmc_sampler.vllm_plugin.request_args import engine_facts, install_prompt_marks, instance_salt

__all__ = ["register"]

logger = logging.getLogger("vllm.qmc_sampler")


def register() -> None:
    """Install the logprobs wrap, the admission facts and the workers' stats method (idempotent).

    Raises:
        ValueError: ``QMC_SAMPLER_SALT`` is malformed (the user's own setting stops the engine at start).
            Nothing else: a step that fails on an unknown vLLM is logged with its traceback and
            skipped, since vLLM calls this in every process and an exception would stop every engine.
    """
    instance_salt()  # a malformed QMC_SAMPLER_SALT stops the engine at start, not each request
    for step in (_one_distribution, _install_logprobs, _record_engine_facts, _keep_model_runner_v2_choice,
                 install_prompt_marks, _add_worker_stats):  # fmt: skip
        try:
            step()
        except Exception:
            logger.exception("qmc-sampler: %s failed on this vLLM and is skipped", step.__name__.strip("_"))


def _one_distribution() -> None:
    """Say once where two distributions declare this package's entry points (this project installed
    before 0.2.0 as ``qmc-sampler`` and again as ``qmc-llm-sampler``): vLLM would load the processor
    twice, and two processors imposing on one row break processed logprobs and double the counters."""
    from importlib.metadata import distributions

    owners = sorted({d.metadata["Name"] for d in distributions()
                     if any(ep.group == "vllm.logits_processors" and ep.value.startswith("qmc_sampler.")
                            for ep in d.entry_points)})  # fmt: skip
    if len(owners) > 1:
        _say_once("twice", f"qmc-sampler: {owners} each declare qmc_sampler's vLLM entry points, so vLLM loads the "
                  "processor more than once: `pip uninstall qmc-sampler` (the name this project had before 0.2.0), "
                  "then reinstall qmc-llm-sampler")  # fmt: skip


def _install_logprobs() -> None:
    from qmc_sampler.vllm_plugin.logprobs import install

    install()


def _add_worker_stats() -> None:
    worker_base = compat.locate("worker_base")
    if not hasattr(worker_base, "qmc_sampler_stats"):
        worker_base.qmc_sampler_stats = _worker_stats


def _wrap_once(owner: Any, name: str, original: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that puts the function it decorates, as a wrapper of ``original``, in ``owner.name``,
    unless ``original`` is a wrapper of ours already (:func:`register` runs again in the same process)."""

    def install(wrapper: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(original, "_qmc_wrapped", False):
            return original
        wrapper = functools.wraps(original)(wrapper)
        wrapper._qmc_wrapped = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)
        return wrapper

    return install


def _worker_stats(worker: Any) -> dict[str, Any]:
    from qmc_sampler.vllm_plugin.processor import plugin_stats

    return plugin_stats(worker)


def _record_engine_facts() -> None:
    """Let admission know its engine: through the validator builder where vLLM has one (>= 0.31),
    else through ``SamplingParams.verify``, which older releases call on every request."""
    try:
        owner, original = compat.locate_with_owner("params_validator")
    except compat.TouchpointError:
        _record_engine_facts_at_verify()
        return

    @_wrap_once(owner, "_build_logits_processors_params_validator", original)
    def build(self: Any) -> Any:
        validate = original(self)
        runner = compat.engine_runner(self.vllm_config)
        facts = _engine_facts(self.vllm_config.speculative_config, self.model_config, runner)

        def validator(params: Any) -> None:
            with engine_facts(_while_drawing(facts)):
                validate(params)

        return validator


def _record_engine_facts_at_verify() -> None:
    try:
        owner, original = compat.locate_with_owner("params_verify")
    except compat.TouchpointError as e:
        logger.warning(
            "qmc-sampler: cannot see the engine's configuration at admission (%s); designed requests under "
            "speculative decoding or an uncorrectable processed logprobs_mode are not refused there",
            e,
        )
        return

    @_wrap_once(owner, "verify", original)
    def verify(self: Any, model_config: Any, speculative_config: Any, *args: Any, **kwargs: Any) -> Any:
        # One engine's facts (its instance salt among them) for all its requests: built at its first
        # request, as vLLM >= 0.31 builds them once when the engine's input processor starts.
        held, facts = _facts_by_engine.get(id(model_config), (None, None))
        if held is None or held() is not model_config:  # (an id is reused only after its config is gone)
            runner = "mrv2" if _mrv2_without_processors() else "v1"
            facts = _engine_facts(speculative_config, model_config, runner)
            _remember_facts(model_config, facts)
        with engine_facts(_while_drawing(facts)):
            return original(self, model_config, speculative_config, *args, **kwargs)


def _while_drawing(facts: Any) -> Any:
    """``facts``, with the plugin inactive where a worker of this engine stopped drawing (its draw failed
    on every backend: :mod:`qmc_sampler.vllm_plugin.processor`), so that admission refuses designs.

    Asked at every admission: one stat of the folder where workers record it, read again only when it
    changed (:func:`qmc_sampler.vllm_engine.checks.broken_below`)."""
    if facts.inactive is not None:
        return facts
    try:
        broken = checks.broken_below()
    except Exception:  # the record's folder cannot be read: admission goes on, said once
        _said_exception("records", "qmc-sampler: cannot read the workers' draw records; admission goes on "
                        "without them (the workers' stats still count failed draws)")  # fmt: skip
        return facts
    if broken is None:
        return facts
    return dataclasses.replace(facts, inactive=f"it stopped drawing: {broken}", refuse_drop_in=True,
                               remedy="restart the engine (its log holds the failed draw's traceback)")  # fmt: skip


def _engine_facts(speculative_config: Any, model_config: Any, runner: str) -> Any:
    """The facts for one engine, warning once per engine where the plugin cannot act at all."""
    from qmc_sampler.vllm_plugin.request_args import EngineFacts

    from qmc_sampler.members.keys import ENV_METHOD

    try:
        if runner == "mrv2" and _mrv2_without_processors():
            inactive, remedy = "it runs Model Runner V2, which runs no logits processors before vLLM 0.31", \
                "unset VLLM_USE_V2_MODEL_RUNNER"  # fmt: skip
        else:
            inactive, remedy = compat.runner_problem(runner), EngineFacts.remedy
    except Exception as e:  # an unknown vLLM: the engine starts, designs are refused (fail closed)
        logger.exception("qmc-sampler: cannot tell whether this engine runs the plugin")
        inactive, remedy = f"its runner could not be checked ({type(e).__name__}: {e})", EngineFacts.remedy
    facts = EngineFacts(
        speculative=speculative_config is not None,
        logprobs_mode=str(getattr(model_config, "logprobs_mode", "raw_logprobs")),
        runner=runner,
        inactive=inactive,
        remedy=remedy,
    )
    why = None
    if facts.speculative:
        why = "runs speculative decoding, which does not run logits processors"
    elif facts.inactive is not None:
        why = f"cannot run the plugin ({facts.inactive})"
    if why:  # facts are built once per engine (the validator builder; the cache above)
        drop_in = os.environ.get(ENV_METHOD)
        logger.warning(
            "qmc-sampler: this engine %s: the plugin is inactive here%s; requests that ask for a design "
            "(qmc_method) are refused",
            why,
            f" (the drop-in {ENV_METHOD}={drop_in} is ignored)" if drop_in else "",
        )
    return facts


#: vLLM < 0.31: each engine's facts by its model config's id, with a weak reference to the config (one
#: entry per engine client alive in this process: an RL loop that builds ``LLM`` again and again leaves none).
_facts_by_engine: dict[int, tuple[Callable[[], Any], Any]] = {}


def _remember_facts(model_config: Any, facts: Any) -> None:
    """File ``facts`` under ``model_config``'s id until the config is collected (then the entry goes)."""
    key = id(model_config)

    def forget(ref: Any) -> None:
        entry = _facts_by_engine.get(key)
        if entry is not None and entry[0] is ref:  # not a later engine's entry under a reused id
            del _facts_by_engine[key]

    try:
        held: Callable[[], Any] = weakref.ref(model_config, forget)
    except TypeError:  # a config that takes no weak reference: held as before (one per engine client)
        held = functools.partial(lambda config: config, model_config)
    _facts_by_engine[key] = (held, facts)


# ---- Model Runner V2 before vLLM 0.31 --------------------------------------------------------------
# vLLM 0.24–0.30 list "custom logits processors" among MRV2's unsupported features whenever *any*
# package declares a ``vllm.logits_processors`` entry point (``VllmConfig.
# _get_v2_model_runner_unsupported_features``): installing qmc-sampler moves every engine of the
# environment to the V1 runner, and VLLM_USE_V2_MODEL_RUNNER=1 then fails at start. Our entry point
# is the package's way in for engines that use designs, so it stays; where it is the only reason,
# the switch is said at engine start, and VLLM_USE_V2_MODEL_RUNNER=1 keeps MRV2 with the plugin
# stepping aside (designs refused at admission: :func:`_engine_facts`). docs/serving.md, "vLLM versions".

_MRV2_FEATURE = "custom logits processors"


def _mrv2_without_processors() -> bool:
    """True on a vLLM whose MRV2 runs no logits processors, where the user asked for MRV2."""
    from vllm import envs

    return not compat.present("mrv2_processor") and getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None) is True


def _keep_model_runner_v2_choice() -> None:
    if compat.present("mrv2_processor"):
        return  # vLLM >= 0.31: MRV2 runs logits processors, the entry point changes nothing
    try:
        owner, original = compat.locate_with_owner("mrv2_unsupported")
    except compat.TouchpointError:
        return

    @_wrap_once(owner, "_get_v2_model_runner_unsupported_features", original)
    def unsupported_features(self: Any) -> list[str]:
        unsupported = original(self)
        if _MRV2_FEATURE not in unsupported or not _only_our_entry_point(self.model_config):
            return unsupported
        if _mrv2_without_processors():
            _say_once("kept", "qmc-sampler: VLLM_USE_V2_MODEL_RUNNER=1: Model Runner V2 kept, though qmc-sampler is "
                      "installed; on this vLLM it runs no logits processors, so qmc-sampler is inactive in this "
                      "engine and refuses requests with a design")  # fmt: skip
            return [feature for feature in unsupported if feature != _MRV2_FEATURE]
        if unsupported == [_MRV2_FEATURE]:
            _say_once("moved", "qmc-sampler: on this vLLM (< 0.31) an installed logits-processor entry point moves "
                      "every engine from Model Runner V2 to the V1 runner, and qmc-sampler's is the only one here: "
                      "this engine runs the V1 runner (designs work). To keep Model Runner V2 without qmc-sampler "
                      "for an engine, set VLLM_USE_V2_MODEL_RUNNER=1 (designs are then refused there)")  # fmt: skip
        return unsupported


def _only_our_entry_point(model_config: Any) -> bool:
    from importlib.metadata import entry_points

    if model_config is None or getattr(model_config, "logits_processors", None):
        return False
    return all(ep.value.startswith("qmc_sampler.") for ep in entry_points(group="vllm.logits_processors"))


_said: set[str] = set()


def _said_exception(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        logger.exception(message)


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        logger.warning(message)
