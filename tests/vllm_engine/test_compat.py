"""The vLLM touch points (qmc_sampler.vllm_engine.compat): the installed release passes the table, and
the source check reads a release without importing it and catches what changed.

`make compat VLLM=X` runs this module, with the plugin and server tests, on vLLM X
(QMC_EXPECT_VLLM=X makes sure the venv really holds that release)."""

import dataclasses
import importlib
import os
import textwrap
from pathlib import Path

import pytest
from qmc_sampler.vllm_engine import compat

vllm = pytest.importorskip("vllm", reason="vLLM not installed")


def test_the_venv_holds_the_release_it_was_built_for():
    expected = os.environ.get("QMC_EXPECT_VLLM")
    if expected is None:
        pytest.skip("QMC_EXPECT_VLLM is set by `make compat` only")
    assert vllm.__version__.split("+")[0] == expected


def test_the_installed_release_passes_its_own_source_check():
    verdicts = compat.check_sources(Path(vllm.__file__).parent.parent)
    problems = {name: v for name, v in verdicts.items() if v.startswith(("MISSING", "SIGNATURE"))}
    assert not problems
    # Before 0.34 the V1 runner and its sampler's wrap; from 0.34 Model Runner V2 alone.
    assert verdicts["v1_sample"] == ("ok" if compat.present("v1_processor") else "not needed (no v1_processor)")
    assert verdicts["interfaces"] != "" and not verdicts["interfaces"].startswith("MISSING")


def test_every_touch_point_the_source_check_finds_is_found_at_run_time():
    verdicts = compat.check_sources(Path(vllm.__file__).parent.parent)
    for name, verdict in verdicts.items():
        if name not in compat.TOUCHPOINTS:  # "loaders", "interfaces": verdicts on the release as a whole
            continue
        if verdict == "ok":
            compat.locate(name)  # raises TouchpointError if the runtime sees otherwise
        elif verdict.startswith("absent"):
            with pytest.raises(compat.TouchpointError, match="not found"):
                compat.locate(name)


def _fake_release(root: Path, sample_params: str) -> Path:
    files = {
        "vllm/v1/sample/sampler.py": f"class Sampler:\n    def sample({sample_params}):\n        pass\n",
        "vllm/v1/sample/logits_processor/__init__.py": "from .interface import BatchUpdate, LogitsProcessor\n",
        "vllm/v1/sample/logits_processor/interface.py": "class BatchUpdate: ...\nclass LogitsProcessor: ...\n"
        "class MoveDirectionality: ...\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_the_source_check_follows_re_exports_and_catches_a_changed_signature(tmp_path):
    same = compat.check_sources(
        _fake_release(tmp_path / "a", "self, logits, sampling_metadata, logprobs_mode_override=None")
    )
    assert same["v1_sample"] == same["v1_processor"] == same["batch_update"] == "ok"
    assert same["move_directionality"] == "ok"
    changed = compat.check_sources(_fake_release(tmp_path / "b", "self, logits, sampling_metadata, extra"))
    assert changed["v1_sample"].startswith("SIGNATURE") and "extra" in changed["v1_sample"]
    assert changed["worker_base"].startswith("MISSING")
    assert changed["mrv2_processor"] == "absent (optional)"
    assert changed["mrv2_sample"] == "not needed (no mrv2_processor)"


def test_the_command_line_exits_1_on_a_changed_release_and_2_on_a_bad_path(tmp_path, capsys):
    assert compat.main([str(_fake_release(tmp_path, "self, logits"))]) == 1
    assert "SIGNATURE" in capsys.readouterr().out
    assert compat.main([str(tmp_path / "nowhere.whl")]) == 2
    assert compat.main([]) == 2


_MRV2_INTERFACE = """
from dataclasses import dataclass

@dataclass(frozen=True)
class LogitsProcRequestState:
    all_token_ids: object
    prompt_len: object
    prefill_len: object

@dataclass(frozen=True)
class LogitsContext:
    idx_mapping_np: object
    {input_ids}
    seq_lens_upper_bound_np: object

class LogitsProcessor:
    def __init__(self, vllm_config, req_states): ...
    def add_request(self, req_idx, sampling_params): return True
    def apply_staged_writes(self): ...
    def apply(self, logits, ctx): ...
"""

_BUFFERS = """
class UvaBackedTensor:
    def __init__(self, size):
        self.cpu = None
        self.np = None

class StagedWriteTensor:
    def __init__(self, size):
        self.gpu = None
"""


def _fake_mrv2_release(root: Path, context_has_input_ids: bool = True) -> Path:
    files = {
        "vllm/v1/worker/gpu/sample/logits_processor/__init__.py":
            "from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcessor, "
            "LogitsProcRequestState\n",
        "vllm/v1/worker/gpu/sample/logits_processor/interface.py":
            _MRV2_INTERFACE.format(input_ids="input_ids: object" if context_has_input_ids else ""),
        "vllm/v1/worker/gpu/buffer_utils.py": _BUFFERS,
    }  # fmt: skip
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_release_with_model_runner_v2_alone_serves_mrv2_and_needs_nothing_of_the_v1_runner(tmp_path):
    verdicts = compat.check_sources(_fake_mrv2_release(tmp_path))
    assert verdicts["interfaces"] == "mrv2"
    assert verdicts["v1_runner"] == "absent (optional)" and verdicts["v1_processor"] == "not needed (no v1_runner)"
    assert verdicts["batch_update"] == verdicts["v1_sample"] == "not needed (no v1_processor)"
    assert all(verdicts[name] == "ok" for name in compat.INTERFACES["mrv2"])


def test_the_source_check_catches_a_field_the_adapter_reads_gone_from_a_class(tmp_path):
    verdicts = compat.check_sources(_fake_mrv2_release(tmp_path, context_has_input_ids=False))
    assert verdicts["mrv2_context"].startswith("SIGNATURE") and "input_ids" in verdicts["mrv2_context"]
    assert verdicts["interfaces"].startswith("MISSING")
    assert compat.main([str(tmp_path)]) == 1


def test_a_release_with_neither_interface_fails_the_source_check(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    verdicts = compat.check_sources(tmp_path)
    assert verdicts["interfaces"].startswith("MISSING: no logits-processor interface")


def test_the_runtime_check_finds_a_field_gone_from_a_class_the_adapter_reads(monkeypatch):
    if not compat.present("mrv2_processor"):
        pytest.skip("this vLLM's MRV2 runs no logits processors")
    assert compat.interface_problem("mrv2") is None
    package = importlib.import_module("vllm.v1.worker.gpu.sample.logits_processor")

    @dataclasses.dataclass(frozen=True)
    class LogitsContext:  # the release's, less input_ids
        idx_mapping_np: object
        seq_lens_upper_bound_np: object

    monkeypatch.setattr(package, "LogitsContext", LogitsContext)
    assert "no input_ids" in compat.interface_problem("mrv2")


def test_a_loader_that_checks_a_base_class_the_plugin_does_not_subclass_fails_the_source_check(tmp_path):
    # vLLM's loaders refuse an entry point's class that is not a subclass of their LogitsProcessor: where
    # that class moved while the loader stayed, every engine would refuse the plugin at start.
    root = _fake_mrv2_release(tmp_path)
    package = root / "vllm/v1/worker/gpu/sample/logits_processor"
    loader = 'LOGITSPROCS_GROUP = "vllm.logits_processors"\nfrom {origin} import LogitsProcessor\n'
    (package / "loader.py").write_text(loader.format(origin="vllm.v1.worker.gpu.sample.logits_processor.interface"))
    assert compat.check_sources(root)["loaders"] == "ok"
    (package / "moved.py").write_text("class LogitsProcessor: ...\n")
    (package / "loader.py").write_text(loader.format(origin="vllm.v1.worker.gpu.sample.logits_processor.moved"))
    assert compat.check_sources(root)["loaders"] == "ok"  # the loader's own name is a place of the table
    (package / "loader.py").unlink()
    (package.parent / "plugins.py").write_text(loader.format(origin="vllm.v1.worker.gpu.sample.logits_processor.moved"))
    verdict = compat.check_sources(root)["loaders"]
    assert verdict.startswith("MISSING base class") and "logits_processor.moved:LogitsProcessor" in verdict
    assert compat.main([str(root)]) == 1
