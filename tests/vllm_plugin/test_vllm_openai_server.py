"""The plugin behind vLLM's own OpenAI server, driven by the official ``openai`` client and by
lm-evaluation-harness.

The servers are started by the docs' recipes (README.md's and docs/serving.md's), with the
drop-in switch ``QMC_SAMPLER=lattice`` and no ``--logits-processors``: the installed entry
point loads the processor. First-token probabilities for the balance checks come from
transformers on the same weights, at temperature 1.5.
"""

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.vllm


def vllm_server(model_dir, serve, log, recipe, model_len=256, **env):
    """vLLM's own server with the drop-in, started by the docs' ``recipe`` (default engine seed)."""
    server = recipe[0]
    command = [*server.argv, "--served-model-name", "tiny", "--host", "127.0.0.1", "--enforce-eager",
               "--dtype", "float32", "--max-model-len", str(model_len)]  # fmt: skip
    return serve(command, log, os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"} | server.env | env)


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve, tmp_path_factory, docs):
    """vLLM's server as a vllm-cpu user starts it (docs/serving.md): the model in a worker process of its own."""
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    recipe = docs.commands("vllm-serve-curl", {"path/to/model": tiny_model_dir})
    with vllm_server(tiny_model_dir, serve, log, recipe, VLLM_ENABLE_V1_MULTIPROCESSING="1") as (_, url):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_the_docs_curl_recipe_gets_one_group_of_8(server, docs):
    host = str(server.base_url).removeprefix("http://").removesuffix("/v1/")
    curl = docs.commands("vllm-serve-curl", {"path/to/model": "tiny", "localhost:8000": host})[1]
    done = subprocess.run(curl.argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(c["index"] for c in json.loads(done.stdout)["choices"]) == list(range(8)), done.stdout


SHORT_TTL = 0.4
#: The auto-group ttl the second server runs with (its fixture's choice: SHORT_TTL, or less on a fast machine).
SECOND_TTL: dict[str, float] = {}


def long_generation_s(client) -> float:
    """Seconds one 500-token generation takes on ``client``'s server (as long as the ttl test's repeats)."""
    start = time.monotonic()
    client.completions.create(model="tiny", prompt=[1, 7, 7, 7], max_tokens=500, temperature=1.5,
                              extra_body={"min_tokens": 500})  # fmt: skip
    return time.monotonic() - start


@pytest.fixture(scope="module")
def second_server(tiny_model_dir, serve, tmp_path_factory, docs):
    """A second replica started by the README's one-line recipe, with a short auto-group ttl.

    The ttl test needs a generation to outlast the ttl, and the gap between one repeat's end and
    the next one's arrival (two short requests) to stay under it. The ttl is SHORT_TTL where a
    500-token generation takes over three times that (every machine this suite has run on);
    on a faster one the server is started again with a third of the generation's time, so the
    condition holds on a machine of any speed instead of assuming one.
    """
    recipe = docs.commands("readme-vllm-serve", {"path/to/model": tiny_model_dir})
    ttl = SHORT_TTL
    for start in range(2):
        log = tmp_path_factory.mktemp("vllm-server-2") / "server.log"
        # The model's whole length (512): the repeats are as long as it allows.
        with vllm_server(tiny_model_dir, serve, log, recipe, 512, QMC_SAMPLER_GROUP_TTL=str(ttl)) as (_, url):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            took = long_generation_s(client)
            if took > 3 * ttl or start == 1:
                SECOND_TTL["ttl"] = ttl
                yield client
                return
        ttl = took / 3


@pytest.mark.parametrize(
    ("xargs", "key"),
    [
        ({"qmc_method": "lattic"}, "qmc_method"),
        ({"qmc_method": "lattice", "qmc_order": "x"}, "qmc_order"),
        ({"qmc_method": "lattice", "qmc_seed": "abc"}, "qmc_seed"),
        ({"qmc_methd": "lattice"}, "qmc_methd"),
    ],
)
def test_bad_vllm_xargs_get_http_400_naming_the_key(server, xargs, key):
    with pytest.raises(openai.BadRequestError) as info:
        server.completions.create(
            model="tiny", prompt="the quick brown", n=2, max_tokens=2, extra_body={"vllm_xargs": xargs}
        )
    assert info.value.status_code == 400
    assert key in str(info.value)


def unfinished_requests(client):
    """vLLM's running + waiting requests, from its Prometheus /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in gauges)


def test_a_stratified_group_of_four_billion_is_served_and_a_larger_one_refused(server):
    xargs = {"qmc_method": "stratified", "qmc_group": "g", "qmc_index": 0, "qmc_n": 4_000_000_000}
    served = server.completions.create(
        model="tiny", prompt="the quick brown", n=2, max_tokens=2, extra_body={"vllm_xargs": xargs}
    )
    assert len(served.choices) == 2
    for bad in ({"qmc_n": 2**32 + 1}, {"qmc_seed": 2**70}, {"qmc_index": 6, "qmc_n": 8}):
        with pytest.raises(openai.BadRequestError) as info:
            server.completions.create(
                model="tiny", prompt="the quick brown", n=4, max_tokens=2, extra_body={"vllm_xargs": xargs | bad}
            )
        assert info.value.status_code == 400
    assert server.completions.create(model="tiny", prompt="the quick brown", max_tokens=1).choices  # still serving
    assert unfinished_requests(server) == 0


def test_identical_prompts_in_one_request_are_groups_of_their_own(server):
    response = server.completions.create(
        model="tiny",
        prompt=["the quick brown", "the quick brown"],
        n=4,
        max_tokens=8,
        temperature=1.5,
        extra_body={"vllm_xargs": {"qmc_seed": 21}, "return_token_ids": True},
    )
    ids = [tuple(c.token_ids) for c in sorted(response.choices, key=lambda c: c.index)]
    assert ids[:4] != ids[4:] and len(set(ids)) > 4, ids  # before: prompt 2's choices were prompt 1's


def test_a_lattice_group_over_http(server):
    response, again = (
        server.completions.create(
            model="tiny",
            prompt="the quick brown",
            n=16,
            max_tokens=3,
            temperature=1.0,
            logprobs=1,
            extra_body={"vllm_xargs": {"qmc_method": "lattice", "qmc_seed": 4}},
        )
        for _ in range(2)
    )
    assert [c.text for c in response.choices] == [c.text for c in again.choices]
    first = [c.logprobs.tokens[0] for c in response.choices]
    # Balanced: each first token appears ⌊16q⌋ or ⌈16q⌉ times, q from the returned logprobs.
    for token in set(first):
        q = np.exp(response.choices[first.index(token)].logprobs.token_logprobs[0])
        assert first.count(token) in (np.floor(16 * q), np.ceil(16 * q)), (token, first.count(token), 16 * q)


T = 1.5


def first_token_probs(hf_model, prompt_ids):
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0, -1]
    return torch.softmax(logits.double() / T, -1).numpy()


def test_64_separate_n1_requests_over_http_form_one_group(server, hf_model, balanced):
    # Sent in 8 waves of 8 concurrent requests: the first 8·w arrivals are waves 1..w.
    prompt = [1, 70, 122, 35]

    def one(_):
        out = server.completions.create(
            model="tiny", prompt=prompt, max_tokens=2, temperature=T, extra_body={"return_token_ids": True}
        )
        return out.choices[0].token_ids[0]

    first = []
    with ThreadPoolExecutor(8) as pool:
        for _ in range(8):
            first += list(pool.map(one, range(8)))
    q = first_token_probs(hf_model, prompt)
    for m in (8, 16, 32, 64):
        assert balanced(first[:m], q), (m, first[:m])


def test_one_seed_on_every_request_over_http_gives_distinct_balanced_samples(server, hf_model, balanced):
    prompt = [1, 90, 12]
    outs = [
        server.completions.create(
            model="tiny", prompt=prompt, max_tokens=4, temperature=T, seed=1234, extra_body={"return_token_ids": True}
        ).choices[0]
        for _ in range(16)  # one after another, like lm-eval with num_concurrent=1
    ]
    assert len({tuple(o.token_ids) for o in outs}) > 4
    assert balanced([o.token_ids[0] for o in outs], first_token_probs(hf_model, prompt))


def test_lm_eval_repeats_come_back_as_one_balanced_group(server, hf_model, tiny_model_dir, tmp_path, lm_eval_repeats):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed")
    from transformers import AutoTokenizer

    base_url = str(server.base_url).rstrip("/")
    (grouped,) = lm_eval_repeats.run(base_url, tmp_path, "qmc_repeats")
    # The same task with the plugin off for its requests: plain vLLM with lm-eval's seed 1234 on all 16.
    (plain,) = lm_eval_repeats.run(base_url, tmp_path, "qmc_repeats_off", "  vllm_xargs: {qmc_auto_group: 0}\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    q = first_token_probs(hf_model, tokenizer.encode("the quick brown"))
    assert lm_eval_repeats.unbalanced(grouped, q, tokenizer) == {}, grouped
    assert len(set(grouped)) > 4
    assert len(set(plain)) == 1  # without the plugin the 16 "samples" are one sample, 16 times


def test_two_replicas_started_alike_never_build_the_same_unseeded_group(server, second_server):
    # Both run vLLM's default engine seed (0); an unseeded group's seed is salted per server process.
    def group(client):
        response = client.completions.create(model="tiny", prompt="pack my box with", n=8, max_tokens=8,
                                             temperature=1.5, extra_body={"return_token_ids": True})  # fmt: skip
        return sorted(tuple(c.token_ids) for c in response.choices)

    assert group(server) != group(second_server)


def test_sequential_seeded_repeats_longer_than_the_ttl_are_distinct_balanced_members(second_server, hf_model, balanced):
    # lm-eval with num_concurrent=1 on a shared server: each repeat is sent when the previous one
    # finished, each generation outlasts the ttl, and other users' requests keep the engine stepping
    # (so the finished member leaves the batch before the next repeat arrives). The ttl counts from
    # when the last member left, so the repeats stay one group.
    prompt = [1, 61, 9, 140]
    outs = []
    for k in range(4):
        start = time.monotonic()
        outs.append(second_server.completions.create(
            model="tiny", prompt=prompt, max_tokens=500, temperature=T, seed=1234,
            extra_body={"return_token_ids": True, "min_tokens": 500},
        ).choices[0])  # fmt: skip
        assert time.monotonic() - start > SECOND_TTL["ttl"]  # else this would not test what it says
        second_server.completions.create(model="tiny", prompt=f"another user {k}", max_tokens=1)
    assert len({tuple(o.token_ids) for o in outs}) == 4
    assert balanced([o.token_ids[0] for o in outs], first_token_probs(hf_model, prompt))
