"""The vLLM touch points (qmc_sampler.vllm_engine.compat): the installed release passes the table, and
the source check reads a release without importing it and catches what changed.

`make compat VLLM=X` runs this module, with the plugin and server tests, on vLLM X
(QMC_EXPECT_VLLM=X makes sure the venv really holds that release)."""

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
    assert verdicts["v1_sample"] == "ok"  # every release in range: the V1 wrap


def test_every_touch_point_the_source_check_finds_is_found_at_run_time():
    verdicts = compat.check_sources(Path(vllm.__file__).parent.parent)
    for name, verdict in verdicts.items():
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
