"""A draw that raises is never served under a design's name (the V1 runner's calls, no engine).

``QMCLogitsProcessor`` is driven as vLLM's V1 runner drives it — vLLM's own ``BatchUpdate``, an
output list per row that grows by the token vLLM takes (the one finite logit of an imposed row) —
on the toy model's logits, with the fused CPU kernel (``qmc_sampler._C.fused_inverse_cdf``)
replaced by one that raises at every call, as a kernel built against another torch or a Triton
compile error on a new GPU would:

* the fused kernel alone fails: every step is still imposed, with the pure-torch path's tokens
  (the same step drawn again), the kernel is dropped after three steps in a row, and the log holds
  one traceback;
* every backend fails: the rows are left to vLLM and counted, the processor stops drawing after
  three steps in a row, and vLLM's front end then refuses designs, naming why.
"""

import gc
import logging

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.vllm_engine import checks
from qmc_sampler.vllm_plugin import QMCLogitsProcessor
from qmc_sampler.vllm_plugin.processor import FAILURES_IN_A_ROW
from vllm import SamplingParams
from vllm.v1.sample.logits_processor.interface import BatchUpdate

from qmc_sampler import kernels

PROMPT = [1, 2, 3]
N, STEPS = 8, 6


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_model_dir, dtype="float32", max_model_len=256, seed=0).create_engine_config()


@pytest.fixture(scope="module")
def toy(toy_factory):
    return toy_factory(vocab=7, depth=2, seed=3)


@pytest.fixture
def cpp_kernel():
    """The fused CPU kernel module (the test needs it to be the backend the processor picks)."""
    if kernels.backend_for(torch.device("cpu")) != "cpp":
        pytest.skip("the fused CPU kernel is not this machine's backend")
    return kernels._cpp_kernel()


def raising(calls):
    def fused_inverse_cdf(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("fused kernel built for another torch")

    return fused_inverse_cdf


def run(vllm_config, toy, steps=STEPS):
    """A group of N lattice members drawn for ``steps`` steps: (tokens per member, per step whether
    every row was imposed, the processor)."""
    processor = QMCLogitsProcessor(vllm_config, torch.device("cpu"), False)
    outputs = [[] for _ in range(N)]
    added = []
    for i in range(N):
        params = SamplingParams(temperature=1.0, extra_args={"qmc_method": "lattice", "qmc_seed": 11,
                                                             "qmc_group": "g", "qmc_index": i, "qmc_n": N})  # fmt: skip
        QMCLogitsProcessor.validate_params(params)
        added.append((i, params, PROMPT, outputs[i]))
    processor.update_state(BatchUpdate(batch_size=N, removed=[], added=added, moved=[]))
    imposed = []
    for _ in range(steps):
        logits = toy.next_logits([o[-1:] for o in outputs])  # a first-order model: the last token
        out = processor.apply(logits.clone())
        finite = torch.isfinite(out)
        imposed.append(bool((finite.sum(dim=1) == 1).all()))
        for i in range(N):  # vLLM takes the one finite token of an imposed row; else it samples (here: argmax)
            outputs[i].append(int(out[i].argmax()))
        processor.update_state(None)
    return outputs, imposed, processor


def tracebacks(caplog):
    return [r for r in caplog.records if "Traceback (most recent call last)" in r.getMessage()]


def test_a_fused_kernel_that_raises_at_every_call_is_replaced_by_the_pure_torch_path(
    vllm_config, toy, cpp_kernel, monkeypatch, caplog
):
    monkeypatch.setenv("QMC_SAMPLER_BACKEND", "torch")
    reference, _, _ = run(vllm_config, toy)
    monkeypatch.delenv("QMC_SAMPLER_BACKEND")
    calls = []
    monkeypatch.setattr(cpp_kernel, "fused_inverse_cdf", raising(calls))
    with caplog.at_level(logging.WARNING, logger="vllm.qmc_sampler"):
        tokens, imposed, processor = run(vllm_config, toy)
    assert all(imposed)  # no row was left to vLLM
    assert tokens == reference  # the pure-torch path's own draws, step for step
    assert len(calls) == FAILURES_IN_A_ROW  # then dropped
    stats = processor.stats()
    assert stats["drawn"] == N * STEPS and stats["draw_failed_rows"] == 0 and stats["unsampleable"] == 0
    assert stats["draw_failures"] == FAILURES_IN_A_ROW and stats["draw_backend"] == "torch"
    assert "cpp backend's draw failed 3 steps in a row (RuntimeError: fused kernel built" in stats["draw_fallback"]
    assert len(tracebacks(caplog)) == 1  # one traceback, then counters
    said = [r.getMessage() for r in caplog.records if "from now on" in r.getMessage()]
    assert len(said) == 1 and "pure-torch path" in said[0]


def test_a_fused_kernel_that_fails_once_is_kept(vllm_config, toy, cpp_kernel, monkeypatch):
    calls = []
    original = cpp_kernel.fused_inverse_cdf

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a passing failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(cpp_kernel, "fused_inverse_cdf", once)
    _, imposed, processor = run(vllm_config, toy)
    stats = processor.stats()
    assert all(imposed) and len(calls) == STEPS  # one per step: the failed one was drawn again on the torch path
    assert (stats["draw_failures"], stats["draw_backend"], stats["draw_fallback"]) == (1, "cpp", None)


def test_when_every_backend_fails_the_rows_go_to_vllm_counted_and_designs_are_refused(
    vllm_config, toy, cpp_kernel, monkeypatch, caplog
):
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    monkeypatch.setattr(cpp_kernel, "fused_inverse_cdf", raising([]))

    def torch_path_fails(*args, **kwargs):
        raise RuntimeError("no memory for the pure-torch path")

    monkeypatch.setattr(kernels, "inverse_cdf", torch_path_fails)
    with caplog.at_level(logging.WARNING, logger="vllm.qmc_sampler"):
        _, imposed, processor = run(vllm_config, toy)
    assert not any(imposed)  # vLLM sampled every row
    stats = processor.stats()
    assert stats["drawn"] == 0 and stats["draw_failed_rows"] == N * STEPS and stats["unsampleable"] == N * STEPS
    assert stats["draw_failures"] == FAILURES_IN_A_ROW  # then it stopped trying
    assert stats["draw_broken"].startswith("its draw failed 3 steps in a row (RuntimeError: no memory")
    # One traceback per backend that failed (the fused kernel's, then the pure-torch path's), then counters.
    assert len(tracebacks(caplog)) == 2
    designed = SamplingParams(n=8, temperature=1.0, max_tokens=4, extra_args={"qmc_method": "lattice"})
    front_end = InputProcessor(vllm_config)  # this process started the engine: its front end sees the record
    try:
        with pytest.raises(VLLMValidationError, match=r"qmc_method.*it stopped drawing: worker pid \d+: its draw"):
            front_end._validate_params(designed, ("generate",))
        # The drop-in's requests too: not served i.i.d. by an engine set up for designs.
        monkeypatch.setenv("QMC_SAMPLER", "lattice")
        with pytest.raises(VLLMValidationError, match=r"drop the engine's QMC_SAMPLER design or restart"):
            front_end._validate_params(SamplingParams(n=8, temperature=1.0, max_tokens=4), ("generate",))
        monkeypatch.delenv("QMC_SAMPLER")
        front_end._validate_params(SamplingParams(temperature=0.0), ("generate",))  # greedy: served
    finally:
        del processor
        gc.collect()
    assert checks.broken_below() is None  # the record goes with the processor
    front_end._validate_params(designed, ("generate",))

