"""The plugin's hooks on the installed vLLM release (``qmc_sampler.vllm_plugin.hooks``): each runner's
sampler is wrapped for logprobs on its own, registering again wraps no touch point twice, and on
releases whose Model Runner V2 runs no logits processors (< 0.31) installing the package is said and
can be undone (``make compat VLLM=X`` runs this on X; CI on each release of ``.ci/run``'s
``COMPAT_VLLM``)."""

import logging
from pathlib import Path

import pytest
from qmc_sampler.vllm_engine import compat

vllm = pytest.importorskip("vllm", reason="vLLM not installed")


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


def test_a_step_that_fails_on_an_unknown_vllm_is_logged_and_the_others_still_run(monkeypatch, caplog):
    # vLLM calls register() in every process before building an engine: an exception there would stop
    # every engine of the environment, designs or not.
    from qmc_sampler.vllm_plugin import hooks

    worker_base = compat.locate("worker_base")
    monkeypatch.delattr(worker_base, "qmc_sampler_stats")

    def _install_logprobs() -> None:  # as on a vLLM that moved what it wraps
        raise AttributeError("module 'vllm.v1.sample' has no attribute 'sampler'")

    monkeypatch.setattr(hooks, "_install_logprobs", _install_logprobs)
    with caplog.at_level(logging.ERROR, logger="vllm.qmc_sampler"):
        hooks.register()
    assert any("install_logprobs failed on this vLLM" in r.getMessage() for r in caplog.records)
    assert hasattr(worker_base, "qmc_sampler_stats")  # the steps after it ran
