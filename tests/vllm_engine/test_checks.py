"""The start-up check (:mod:`qmc_sampler.vllm_engine.checks`) through both its doors, on stand-in
engines: ``require_plugin`` (``vllm.LLM``) and ``require_plugin_async`` (``AsyncLLM``) give the same
verdicts, in the same order (the workers are not asked when the front-end lets the probe through),
and both send one designed token whose draw the workers' counters must show."""

import asyncio

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")

from qmc_sampler.vllm_engine.checks import PROBE_METHOD, require_plugin, require_plugin_async

RUNS = [{"processors": 1, "interface": "v1", "drawn": 0, "draw_failed_rows": 0}] * 2


class Engine:
    """An ``LLM`` or ``AsyncLLM`` stand-in: its front-end refuses the probe or not; its workers
    answer ``stats`` (or the RPC raises ``rpc_error``), and a designed request moves their counters
    as ``draws`` says: ``"drawn"`` (the plugin drew it), ``"failed"`` (the draw failed: the row went
    to vLLM) or ``"unseen"`` (no worker drew it)."""

    def __init__(self, refuses=True, stats=RUNS, rpc_error=None, draws="drawn"):
        self.refuses, self.rpc_error, self.draws, self.asked = refuses, rpc_error, draws, []
        self.stats = [dict(worker) for worker in stats]
        self.engine_core = object()  # no data-parallel client

    def _admit(self, params) -> None:
        method = params.extra_args["qmc_method"]
        if method == PROBE_METHOD:
            if self.refuses:
                raise ValueError(f"unknown qmc_method {method!r}")
            return
        for worker in self.stats:  # the workers' step: a designed row
            if self.draws == "drawn":
                worker["drawn"] += 1
            elif self.draws == "failed":
                worker["draw_failed_rows"] += 1
                worker["draw_error"] = "RuntimeError: no kernel"

    def _rpc(self, name):
        self.asked.append(name)
        if self.rpc_error:
            raise self.rpc_error
        return [dict(worker) for worker in self.stats]

    # vllm.LLM
    def generate(self, prompts, params, use_tqdm=True):
        self._admit(params)
        return []

    def collective_rpc(self, name):
        return self._rpc(name)


class AsyncEngine(Engine):
    async def _outputs(self, params):
        self._admit(params)
        yield "output"

    def generate(self, prompt, params, request_id, data_parallel_rank=None):
        return self._outputs(params)

    async def collective_rpc(self, name):
        return self._rpc(name)


def check(door: str, **engine):
    if door == "sync":
        return require_plugin(Engine(**engine))
    return asyncio.run(require_plugin_async(AsyncEngine(**engine)))


@pytest.mark.parametrize("door", ["sync", "async"])
def test_an_engine_that_runs_the_plugin_passes_with_its_first_workers_stats(door):
    assert check(door) == RUNS[0] | {"drawn": 1}  # after the designed token it drew


@pytest.mark.parametrize("door", ["sync", "async"])
def test_a_front_end_without_the_processor_fails_before_the_workers_are_asked(door):
    engine = (Engine if door == "sync" else AsyncEngine)(refuses=False)
    with pytest.raises(RuntimeError, match="this vLLM engine does not run the qmc-sampler logits processor"):
        require_plugin(engine) if door == "sync" else asyncio.run(require_plugin_async(engine))
    assert engine.asked == []


@pytest.mark.parametrize("door", ["sync", "async"])
def test_workers_without_the_processor_are_named(door):
    with pytest.raises(RuntimeError, match=r"vLLM worker\(s\) \[1\] do not run"):
        check(door, stats=[RUNS[0], {"processors": 0}])


@pytest.mark.parametrize("door", ["sync", "async"])
def test_an_rpc_that_fails_is_one_line_without_the_rpcs_traceback(door):
    with pytest.raises(RuntimeError, match=r"cannot ask the vLLM workers .*AttributeError: no such method") as info:
        check(door, rpc_error=AttributeError("no such method"))
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_the_probe_is_the_method_the_processor_refuses():
    engine = Engine()
    seen = []
    engine._admit = lambda params: seen.append(params.extra_args) or Engine._admit(engine, params)
    require_plugin(engine)
    assert seen[0] == {"qmc_method": PROBE_METHOD}
    assert seen[1:] == [{"qmc_method": "lattice", "qmc_auto_group": 0}]  # then one designed token, a group of its own


def test_the_sync_door_works_inside_a_running_event_loop():
    async def inside():  # a notebook or an async caller of a vllm.LLM
        return require_plugin(Engine())

    assert asyncio.run(inside()) == RUNS[0] | {"drawn": 1}


@pytest.mark.parametrize("door", ["sync", "async"])
def test_an_engine_whose_draw_fails_is_refused_naming_the_error(door):
    # The kernel fails at every call and the rows go to vLLM: admission alone would pass.
    with pytest.raises(RuntimeError, match=r"draw fails in vLLM engine\(s\) \[0\] \(RuntimeError: no kernel\)"):
        check(door, draws="failed")


@pytest.mark.parametrize("door", ["sync", "async"])
def test_an_engine_whose_workers_never_draw_the_designed_token_is_refused(door):
    with pytest.raises(RuntimeError, match=r"engine\(s\) \[0\] served a designed request without the qmc-sampler"):
        check(door, draws="unseen")


@pytest.mark.parametrize("door", ["sync", "async"])
def test_a_worker_that_stopped_drawing_is_named(door):
    stopped = {**RUNS[0], "draw_broken": "its draw failed 3 steps in a row (RuntimeError: no kernel)"}
    with pytest.raises(RuntimeError, match=r"stopped drawing in vLLM worker\(s\) \[1\] \(its draw failed 3 steps"):
        check(door, stats=[RUNS[0], stopped])


@pytest.mark.parametrize("door", ["sync", "async"])
def test_workers_whose_processor_steps_aside_are_named_with_the_reason(door):
    inactive = RUNS[0] | {"inactive": "vllm.v1.worker.gpu.sample.logits_processor:LogitsContext not found"}
    with pytest.raises(RuntimeError, match=r"inactive in vLLM worker\(s\) \[0\] \(.*LogitsContext not found"):
        check(door, stats=[inactive, RUNS[1]])


def test_a_data_parallel_client_that_cannot_ask_each_engine_is_refused():
    from types import SimpleNamespace

    engine = AsyncEngine()
    engine.engine_core = SimpleNamespace(core_engines=[b"\x00\x00", b"\x01\x00"])  # two engines, no per-engine call
    with pytest.raises(RuntimeError, match=r"cannot ask each of its 2 data-parallel engines"):
        asyncio.run(require_plugin_async(engine))
    assert engine.asked == []  # collective_rpc would answer for the first engine only


def test_damaged_or_foreign_draw_records_never_fail_an_admission(tmp_path, monkeypatch):
    # vLLM's front end reads the records at every admission, designs or not: a record another release
    # wrote, a damaged one or an absurd file name is passed over, never an exception in every request.
    import json
    import os
    import tempfile

    from qmc_sampler.vllm_engine import checks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(checks, "_cache", {"mtime": None, "read_at": 0, "records": {}})
    folder = tmp_path / f"qmc-sampler-draws-{os.getuid()}"
    folder.mkdir(mode=0o700)
    me = os.getpid()
    (folder / f"broken-{me}").write_text(json.dumps([1, 2]))
    (folder / "broken-99999999999999999999").write_text(json.dumps({"reason": "x", "above": []}))
    (folder / f"broken-{os.getppid()}").write_text(json.dumps({"reason": None, "above": [me]}))
    assert checks.broken_below() is None
    (folder / f"broken-{me}").write_text(json.dumps({"reason": "E" * 5000, "above": []}))
    checks._cache["mtime"] = None
    assert checks.broken_below() == f"worker pid {me}: {'E' * 240}"  # a bounded reason, in 400s and /stats
    folder.chmod(0o777)  # a folder others may write to is no record of this user's
    checks._cache["mtime"] = None
    assert checks.broken_below() is None
