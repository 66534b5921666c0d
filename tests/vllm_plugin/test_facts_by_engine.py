"""vLLM < 0.31's way for admission to know its engine (``SamplingParams.verify``, wrapped by the plugin's
hooks): one engine's facts for all its requests, and nothing kept once its engine client is gone.

An RL loop builds ``vllm.LLM`` again and again in one process; each engine brings its own model config.
The wrap is installed here on the running vLLM too (it is the path of releases whose front end has no
validator builder) and taken off again after the test.
"""

import copy
import gc
import weakref

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed")
from vllm import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def model_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=tiny_model_dir, enforce_eager=True, dtype="float32", max_model_len=256)
    return args.create_engine_config().model_config


@pytest.fixture
def hooks(monkeypatch):
    from qmc_sampler.vllm_plugin import hooks

    monkeypatch.setattr(SamplingParams, "verify", SamplingParams.verify)  # put back as it was after the test
    hooks._record_engine_facts_at_verify()
    return hooks


def admit(config) -> None:
    SamplingParams(n=2, temperature=1.0, extra_args={"qmc_method": "lattice"}).verify(config, None, None, None)


def test_engine_clients_built_again_and_again_leave_no_facts_behind(hooks, model_config):
    gc.collect()  # engines of earlier tests in this process: their entries go now, not during the count
    before = len(hooks._facts_by_engine)
    gone = []
    for _ in range(3):  # three LLM objects, one after the other
        config = copy.copy(model_config)
        admit(config)
        assert len(hooks._facts_by_engine) == before + 1
        gone.append(weakref.ref(config))
        del config
        gc.collect()
    assert [ref() for ref in gone] == [None] * 3  # no engine's config outlives it (they were kept for good)
    assert len(hooks._facts_by_engine) == before


def test_one_engine_keeps_its_facts_for_all_its_requests(hooks, model_config):
    config = copy.copy(model_config)
    admit(config)
    facts = hooks._facts_by_engine[id(config)][1]
    admit(config)
    assert hooks._facts_by_engine[id(config)][1] is facts  # its instance salt, drawn once per engine client
    other = copy.copy(model_config)
    admit(other)
    assert hooks._facts_by_engine[id(other)][1].salt != facts.salt
