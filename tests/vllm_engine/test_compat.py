"""The vLLM touch points (qmc_sampler.vllm_engine.compat): the installed release passes the table, the
source check reads a release without importing it and catches what changed, and on releases whose
Model Runner V2 runs no logits processors (< 0.31) installing the package is said and can be undone.

`make compat VLLM=X` runs this module, with the plugin and server tests, on vLLM X
(QMC_EXPECT_VLLM=X makes sure the venv really holds that release)."""

import logging
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


def test_each_runner_is_wrapped_on_its_own():
    from qmc_sampler.vllm_plugin import logprobs

    logprobs.install()
    assert logprobs.installed("v1"), logprobs.reason("v1")
    has_mrv2_processors = compat.check_sources(Path(vllm.__file__).parent.parent)["mrv2_processor"] == "ok"
    assert logprobs.installed("mrv2") == has_mrv2_processors, logprobs.reason("mrv2")


def test_registering_again_wraps_no_touch_point_twice():
    from qmc_sampler.vllm_plugin import hooks

    hooks.register()
    hooks.register()  # vLLM loads general plugins once per engine it builds in a process
    wrapped = []
    for name in ("params_validator", "params_verify", "mrv2_unsupported"):
        try:
            _, found = compat.locate_with_owner(name)
        except compat.TouchpointError:
            continue
        if getattr(found, "_qmc_wrapped", False):
            wrapped.append(name)
            assert not getattr(found.__wrapped__, "_qmc_wrapped", False), name
    assert wrapped  # at least the admission facts' touch point (validator builder or SamplingParams.verify)


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


# ---- Model Runner V2 before vLLM 0.31 (read in each release's VllmConfig) ----------------------------


@pytest.fixture(scope="module")
def engine_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=tiny_model_dir, enforce_eager=True, dtype="float32", max_model_len=256)
    return args.create_engine_config()


def _mrv2_runs_processors() -> bool:
    return compat.present("mrv2_processor")


def test_where_mrv2_runs_processors_installing_the_package_changes_no_runner(engine_config):
    if not _mrv2_runs_processors():
        pytest.skip("this vLLM's MRV2 runs no logits processors (< 0.31): see the tests below")
    from qmc_sampler.vllm_plugin import hooks

    hooks.register()
    assert "custom logits processors" not in engine_config._get_v2_model_runner_unsupported_features()


def test_before_0_31_the_move_to_the_v1_runner_is_said_and_vllm_use_v2_model_runner_keeps_mrv2(
    engine_config, monkeypatch, caplog
):
    if _mrv2_runs_processors():
        pytest.skip("this vLLM's MRV2 runs logits processors: installing the package moves no engine")
    from qmc_sampler.vllm_plugin import hooks

    hooks.register()
    logging.getLogger("vllm.qmc_sampler").propagate = True  # vLLM's logging setup stops vllm.* propagating
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm.qmc_sampler"):
        hooks._said.clear()
        assert engine_config._get_v2_model_runner_unsupported_features() == ["custom logits processors"]
    assert "moves every engine from Model Runner V2 to the V1 runner" in caplog.text
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert "custom logits processors" not in engine_config._get_v2_model_runner_unsupported_features()


def test_before_0_31_a_design_on_a_kept_mrv2_engine_is_refused_at_admission(engine_config, monkeypatch):
    if _mrv2_runs_processors():
        pytest.skip("this vLLM's MRV2 runs logits processors")
    from qmc_sampler.vllm_plugin import hooks
    from vllm import SamplingParams

    hooks.register()
    monkeypatch.setattr(hooks, "_facts_by_engine", {})  # each half below is an engine started anew
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    designed = SamplingParams(n=2, temperature=1.0, extra_args={"qmc_method": "lattice"})
    with pytest.raises(Exception, match=r"qmc_method.*Model Runner V2"):  # VLLMValidationError
        designed.verify(engine_config.model_config, None, None, None)
    SamplingParams(n=2, temperature=1.0).verify(engine_config.model_config, None, None, None)  # served
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    hooks._facts_by_engine.clear()
    SamplingParams(n=2, temperature=1.0, extra_args={"qmc_method": "lattice"}).verify(
        engine_config.model_config, None, None, None
    )  # the V1 runner: served with its design
