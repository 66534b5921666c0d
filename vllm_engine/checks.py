"""Start-up checks: does this engine really run the plugin?

A result labelled ``lattice`` from an engine that never loaded the processor
would silently be i.i.d. sampling. Before a server or an evaluation run uses an
engine, :func:`require_plugin` (``vllm.LLM``) / :func:`require_plugin_async`
(``AsyncLLM``) check both halves and fail with one line otherwise:

* the front-end: a request with an invalid ``qmc_method`` must be refused at
  admission (the processor's ``validate_params``); and
* every worker: ``collective_rpc("qmc_sampler_stats")`` (added by
  :mod:`qmc_sampler.vllm_plugin.hooks`) must find a processor instance.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["PROBE_METHOD", "engine_stats_async", "require_plugin", "require_plugin_async"]

PROBE_METHOD = "-qmc-sampler-probe-"
_HOW = (
    "install qmc-llm-sampler in the engine's environment (its entry points load the processor), or pass "
    "logits_processors=['qmc_sampler.vllm_plugin:QMCLogitsProcessor']"
)


def _probe_params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, extra_args={"qmc_method": PROBE_METHOD})


def _front_end_refused(error: Exception | None) -> None:
    if error is None:
        raise RuntimeError(f"this vLLM engine does not run the qmc-sampler logits processor: {_HOW}")
    if PROBE_METHOD not in str(error):  # refused for another reason: the plugin is there but cannot act
        raise RuntimeError(f"this vLLM engine refuses designs: {error}")


def _check_workers(stats: list[dict[str, Any]]) -> dict[str, Any]:
    missing = [i for i, s in enumerate(stats) if not s.get("processors")]
    if missing:
        raise RuntimeError(f"vLLM worker(s) {missing} do not run the qmc-sampler logits processor: {_HOW}")
    inactive = {i: s["inactive"] for i, s in enumerate(stats) if s.get("inactive")}
    if inactive:
        raise RuntimeError(
            f"the qmc-sampler logits processor is inactive in vLLM worker(s) {sorted(inactive)} "
            f"({next(iter(inactive.values()))}): use a vLLM release of qmc-sampler's tested range"
        )
    return stats[0]


def _rpc_failed(error: Exception) -> RuntimeError:
    return RuntimeError(
        f"cannot ask the vLLM workers whether they run qmc-sampler ({type(error).__name__}: {error}); "
        "if VLLM_PLUGINS is set, include 'qmc_sampler' in it"
    )


def require_plugin(llm: Any) -> dict[str, Any]:
    """Check a ``vllm.LLM`` runs the processor in its front-end and workers.

    Returns:
        The first worker's :func:`~qmc_sampler.vllm_plugin.processor.plugin_stats`.

    Raises:
        RuntimeError: one line saying which half is missing and how to fix it.
    """

    async def probe() -> None:
        llm.generate([{"prompt_token_ids": [0]}], _probe_params(), use_tqdm=False)

    async def workers() -> list[dict[str, Any]]:
        return llm.collective_rpc("qmc_sampler_stats")

    # Its awaits are of these synchronous calls, so it never suspends: one step runs it to the end,
    # in this thread, without an event loop.
    check = _require(probe, workers)
    try:
        check.send(None)
    except StopIteration as done:
        return done.value
    check.close()
    raise AssertionError("the plugin check suspended")


async def engine_stats_async(engine: Any) -> list[dict[str, Any]]:
    """Every worker's plugin stats, across all data-parallel engines of an ``AsyncLLM``.

    ``AsyncLLM.collective_rpc`` answers for the first engine only when there are
    several; vLLM's data-parallel client asks each one with ``call_utility_all_async``.
    """
    core = engine.engine_core
    if hasattr(core, "call_utility_all_async") and len(getattr(core, "core_engines", ())) > 1:
        per_engine = await core.call_utility_all_async("collective_rpc", "qmc_sampler_stats", None, (), None)
        return [worker for workers in per_engine for worker in workers]
    return await engine.collective_rpc("qmc_sampler_stats")


async def require_plugin_async(engine: Any) -> dict[str, Any]:
    """:func:`require_plugin` for an ``AsyncLLM`` (the server's engine), every data-parallel engine included."""

    async def probe() -> None:
        async for _ in engine.generate({"prompt_token_ids": [0]}, _probe_params(), "qmc-sampler-probe"):
            pass

    return await _require(probe, lambda: engine_stats_async(engine))


async def _require(
    probe: Callable[[], Awaitable[Any]], workers: Callable[[], Awaitable[list[dict[str, Any]]]]
) -> dict[str, Any]:
    """The check of both halves, written once for both engines: ``probe`` sends the request the
    front-end must refuse, ``workers`` asks every worker for its stats."""
    error = None
    try:
        await probe()
    except Exception as e:  # vLLM wraps validate_params' ValueError (VLLMValidationError)
        error = e
    _front_end_refused(error)
    try:
        stats = await workers()
    except Exception as e:
        raise _rpc_failed(e) from None
    return _check_workers(stats)
