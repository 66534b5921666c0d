"""``qmc-serve`` end to end: a real server process on loopback, the official ``openai`` client."""

import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.vllm
PROMPT = "the quick brown"


@pytest.fixture(scope="module")
def base_url(tiny_model_dir, http_helpers, tmp_path_factory):
    free_port, wait_for_http = http_helpers
    port = free_port()
    log = open(tmp_path_factory.mktemp("qmc-serve") / "server.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qmc_sampler.server.main",
            "--model",
            tiny_model_dir,
            "--served-model-name",
            "tiny",
            "--port",
            str(port),
            "--sampler",
            "lattice",
            "--max-n",
            "64",
            "--kv-cache-gb",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def texts(response):
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{base_url}/health").json()["status"] == "ok"


def test_n8_completion_is_a_balanced_lattice_group_with_usage(client):
    response = client.completions.create(
        model="tiny", prompt=PROMPT, n=8, max_tokens=4, logprobs=1, extra_body={"sampler": "lattice", "sampler_seed": 3}
    )
    assert sorted(c.index for c in response.choices) == list(range(8))
    assert response.model_extra["sampler"] == "lattice" and response.model_extra["sampler_seed"] == 3
    assert response.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in response.choices)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    first = [c.logprobs.tokens[0] for c in response.choices]
    for token in set(first):
        q = np.exp(response.choices[first.index(token)].logprobs.token_logprobs[0])
        assert first.count(token) in (np.floor(8 * q), np.ceil(8 * q))


def test_chat_with_n8(client):
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        n=8,
        max_tokens=3,
        seed=11,
        logprobs=True,
        top_logprobs=2,
    )
    assert sorted(c.index for c in response.choices) == list(range(8))
    assert all(c.message.role == "assistant" for c in response.choices)
    for choice in response.choices:
        for position in choice.logprobs.content:
            tops = position.top_logprobs
            assert len(tops) == 2, tops  # exactly top_logprobs=2 alternatives at every position
            assert tops[0].logprob >= tops[1].logprob
            assert position.logprob <= tops[0].logprob + 1e-6
            if position.token in [t.token for t in tops]:
                assert position.logprob == pytest.approx(next(t.logprob for t in tops if t.token == position.token))
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], n=8, max_tokens=3, seed=11
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in response.choices]


def test_the_group_seed_reproduces_the_group(client):
    a = client.completions.create(model="tiny", prompt=PROMPT, n=8, max_tokens=5)
    seed = a.model_extra["sampler_seed"]
    b = client.completions.create(model="tiny", prompt=PROMPT, n=8, max_tokens=5, extra_body={"sampler_seed": seed})
    assert texts(a) == texts(b)


def test_extended_groups_equal_one_big_group(client):
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, n=16, max_tokens=5, extra_body={"sampler": "lattice", "sampler_seed": 9}
    )
    first = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=8,
        max_tokens=5,
        extra_body={"sampler": "lattice", "sampler_seed": 9, "sampler_group_size": 16},
    )
    second = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=8,
        max_tokens=5,
        extra_body={"sampler": "lattice", "sampler_seed": 9, "sampler_offset": 8, "sampler_group_size": 16},
    )
    assert texts(first) + texts(second) == texts(whole)


def test_streaming_interleaves_choices_and_ends_with_usage_and_done(client, base_url):
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=4,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"sampler_seed": 2},
    )
    pieces: dict[int, str] = {}
    usage = None
    order = []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + choice.text
            order.append(choice.index)
    assert sorted(pieces) == [0, 1, 2, 3]
    assert len(set(order[:4])) > 1  # interleaved, not one choice after another
    whole = client.completions.create(model="tiny", prompt=PROMPT, n=4, max_tokens=6, extra_body={"sampler_seed": 2})
    assert [pieces[i] for i in range(4)] == texts(whole)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    raw = httpx.post(
        f"{base_url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "n": 2, "max_tokens": 2, "stream": True}
    ).text
    assert raw.rstrip().endswith("data: [DONE]")


def test_chat_streaming(client):
    request = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4, seed=21)
    roles, content = {}, {}
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    whole = client.chat.completions.create(**request)
    assert [content[i] for i in range(3)] == [c.message.content for c in whole.choices]


def test_a_client_that_disconnects_mid_stream_frees_the_engine(base_url):
    body = {"model": "tiny", "prompt": PROMPT, "n": 16, "max_tokens": 480, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        assert httpx.get(f"{base_url}/health").json()["unfinished_requests"] > 0
    deadline = time.monotonic() + 5
    while httpx.get(f"{base_url}/health").json()["unfinished_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{base_url}/health").json()["unfinished_requests"] == 0


BAD = [
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"n": "two"}, "n"),
    ({"sampler": "lattic"}, "sampler"),
    ({"temperature": 0.0, "sampler": "lattice"}, "temperature"),
    ({"max_tokens": 100_000}, "prompt"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"logprobs": 99}, "logprobs"),
    ({"sampler_offset": 4}, "sampler_group_size"),
    ({"sampler_offset": 4, "sampler_group_size": 8, "n": 8}, "sampler_group_size"),
    ({"vllm_xargs": {"qmc_method": "lattic"}}, "vllm_xargs"),
    ({"vllm_xargs": {"qmc_index": 1}}, "vllm_xargs"),
    ({"vllm_xargs": {"nested": {"a": 1}}}, "vllm_xargs"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_input_is_a_400_in_openai_shape_naming_the_field(base_url, fields, param):
    response = httpx.post(f"{base_url}/v1/completions", json={"model": "tiny", "prompt": PROMPT} | fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_vllm_xargs_choose_the_design_too(client):
    a = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=4,
        max_tokens=3,
        extra_body={"vllm_xargs": {"qmc_method": "sobol", "qmc_seed": 5}},
    )
    b = client.completions.create(
        model="tiny", prompt=PROMPT, n=4, max_tokens=3, extra_body={"sampler": "sobol", "sampler_seed": 5}
    )
    assert a.model_extra["sampler"] == "sobol" and texts(a) == texts(b)


def test_malformed_json_and_missing_fields_are_400(base_url):
    bad = httpx.post(f"{base_url}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "tiny"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"


def test_the_openai_client_sees_bad_requests_as_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 4000}], n=2)
    assert "maximum context length" in str(info.value)
