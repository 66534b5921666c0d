"""``qmc-serve`` on a network: API key, limits, metrics, request log, structured outputs, SIGTERM.

One real server process (tiny model) with a key from the environment, a small
body limit and 16 members in flight; the official ``openai`` client and raw
HTTP. The last test stops the server with SIGTERM in the middle of a stream.
"""

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.vllm
KEY = "sk-test-4d1f9c2a"
LIMIT = 16
PROMPT = "the quick brown"


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve, tmp_path_factory, docs):
    log = tmp_path_factory.mktemp("qmc-serve-prod") / "server.log"
    # docs/serving.md's recipe: the key from the environment, where `ps` does not show it.
    recipe = docs.commands("qmc-serve-key", {"QMC_SERVE_API_KEY=...": f"QMC_SERVE_API_KEY={KEY}"})[0]
    command = [
        *recipe.argv, "--model", tiny_model_dir, "--served-model-name", "tiny",
        "--kv-cache-gb", "1", "--max-body-bytes", "4096", "--max-members-in-flight", str(LIMIT),
        "--shutdown-timeout", "0",  # abort at once: on one thread the 480-token group below took under 1 s
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
    ]  # fmt: skip
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"} | recipe.env
    assert env["QMC_SERVE_API_KEY"] == KEY
    with serve(command, log, env) as (process, url):
        yield {"url": url, "process": process, "log": log}


def stats(server):
    response = httpx.get(server["url"] + "/stats", headers=auth())
    assert response.status_code == 200, response.text
    return response.json()


def client(server, key=KEY):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=key, max_retries=0)


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    ),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_v1_route_needs_the_key(server, method, path, body):
    url = server["url"] + path
    for headers in ({}, auth("wrong"), {"Authorization": KEY}):
        response = httpx.request(method, url, json=body, headers=headers)
        assert response.status_code == 401, (path, headers, response.text)  # vLLM's key check (ours on POSTs)
        assert KEY not in response.text
    assert httpx.request(method, url, json=body, headers=auth()).status_code == 200


def test_health_and_metrics_are_open_and_the_client_sees_authentication_errors(server):
    assert httpx.get(server["url"] + "/health").status_code == 200
    assert httpx.get(server["url"] + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").models.list()
    assert [m.id for m in client(server).models.list().data] == ["tiny"]


def test_a_body_over_the_limit_is_refused_naming_it(server):
    response = httpx.post(
        server["url"] + "/v1/completions", json={"model": "tiny", "prompt": "x" * 5000}, headers=auth()
    )
    assert response.status_code == 400 and "--max-body-bytes" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit applies as the body arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    streamed = httpx.post(server["url"] + "/v1/completions", content=chunks(), headers=auth())
    assert streamed.status_code == 400 and "--max-body-bytes" in streamed.json()["error"]["message"]


def test_more_members_than_the_limit_is_a_400_and_a_burst_beyond_it_gets_429s(server):
    with pytest.raises(openai.BadRequestError, match="--max-members-in-flight=16"):
        client(server).completions.create(model="tiny", prompt=PROMPT, n=LIMIT + 1, max_tokens=1)

    burst = 4 * LIMIT // 8  # 4x the limit in members, sent at once
    start = threading.Barrier(burst)

    def one(_):
        start.wait()  # overlap however slowly the threads get going on a loaded machine
        return httpx.post(
            server["url"] + "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "n": 8, "max_tokens": 160, "min_tokens": 160},
            headers=auth(),
            timeout=120,
        )

    with ThreadPoolExecutor(burst) as pool:
        responses = list(pool.map(one, range(burst)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1 and set(statuses) <= {200, 429}, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert "--max-members-in-flight" in refused.json()["error"]["message"]
    assert stats(server)["members_in_flight"] == 0


def metric(server, name, **labels):
    text = httpx.get(server["url"] + "/metrics").text
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_metrics_parse_and_move_with_traffic(server):
    # vLLM's HTTP metrics and ours on one /metrics
    requests = metric(server, "http_requests_total", handler="/v1/completions", status="2xx")
    members = metric(server, "qmc_serve_members_total", design="lattice")
    groups = metric(server, "qmc_serve_groups_total", design="lattice")
    rejected = metric(server, "qmc_serve_rejected_total", reason="auth")
    client(server).completions.create(model="tiny", prompt=[PROMPT, "pack my box"], n=4, max_tokens=2)
    httpx.post(server["url"] + "/v1/completions", json={"model": "tiny", "prompt": PROMPT})  # no key
    assert metric(server, "http_requests_total", handler="/v1/completions", status="2xx") == requests + 1
    assert metric(server, "qmc_serve_members_total", design="lattice") == members + 8
    assert metric(server, "qmc_serve_groups_total", design="lattice") == groups + 2
    assert metric(server, "qmc_serve_rejected_total", reason="auth") == rejected + 1
    assert metric(server, "http_request_duration_seconds_count", handler="/v1/completions") >= 1
    names = {f.name for f in parser.text_string_to_metric_families(httpx.get(server["url"] + "/metrics").text)}
    assert "qmc_serve_members_in_flight" in names


def test_the_members_of_a_group_share_their_prompts_kv_blocks(server):
    # qmc-serve's CPU block size (32) lets vLLM's prefix cache share a 70-token prompt, which its
    # default of 128 never would: every member would prefill it again.
    prompt = list(range(100, 170))
    hits = metric(server, "vllm:prefix_cache_hits_total")
    client(server).completions.create(model="tiny", prompt=prompt, n=8, max_tokens=1, extra_body={"sampler_seed": 3})
    assert metric(server, "vllm:prefix_cache_hits_total") - hits >= 7 * 64  # two full blocks for 7 of the 8


def test_one_structured_log_line_per_request_without_prompt_or_key(server):
    marker = "zebra quartz sphinx"
    client(server).completions.create(model="tiny", prompt=marker, n=2, max_tokens=2, extra_body={"sampler_seed": 5})
    time.sleep(0.5)
    text = server["log"].read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith('{"event": "request"')]
    mine = [line for line in lines if line["seed"] == 5 and line["n"] == 2]
    assert mine and set(mine[-1]) == {"event", "id", "endpoint", "design", "n", "seed", "status", "latency_s"}
    assert mine[-1]["design"] == "lattice" and mine[-1]["status"] == 200
    assert marker not in text and KEY not in text


SCHEMA = {
    "type": "object",
    "properties": {"w": {"enum": ["the", "quick", "brown", "fox", "jumps", "lazy", "dog", "box", "vow", "judge"]}},
    "required": ["w"],
    "additionalProperties": False,
}


def test_lattice_members_under_a_json_schema_are_valid_and_balanced(server):
    response = client(server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "pick a word"}],
        n=8,
        max_tokens=24,
        temperature=1.0,  # the reported (raw) logprobs are then the distribution the members are drawn from
        logprobs=True,
        top_logprobs=20,
        response_format={"type": "json_schema", "json_schema": {"name": "word", "schema": SCHEMA}},
        extra_body={"sampler": "lattice", "sampler_seed": 3},
    )
    values = [json.loads(c.message.content)["w"] for c in response.choices]  # every member valid JSON
    assert all(v in SCHEMA["properties"]["w"]["enum"] for v in values)
    # The grammar mask applies before the plugin's draw: at the first position with a
    # choice, the members split ⌊8q⌋/⌈8q⌉ by the *constrained* distribution.
    contents = [c.logprobs.content for c in response.choices]
    t = next(t for t in range(len(contents[0])) if sum(x.logprob > -9000 for x in contents[0][t].top_logprobs) > 1)
    assert len({tuple(x.token for x in c[:t]) for c in contents}) == 1  # forced tokens shared by all
    q: dict[str, float] = {}
    for x in contents[0][t].top_logprobs:
        q[x.token] = q.get(x.token, 0.0) + float(np.exp(x.logprob))
    chosen = [c[t].token for c in contents]
    for token, p in q.items():
        assert chosen.count(token) in (np.floor(8 * p), np.ceil(8 * p)), (token, chosen.count(token), 8 * p)
    assert len(set(chosen)) > 1


def test_json_object_and_vllms_structured_outputs_are_accepted(server):
    out = client(server).completions.create(
        model="tiny", prompt=PROMPT, n=4, max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert {c.text for c in out.choices} <= {"yes", "no"}
    obj = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content.startswith("{")


def test_a_chat_request_with_a_tool_is_served_as_vllm_serves_it(server):
    # vLLM's chat path handles tools: with no tool parser configured, a tool definition with
    # tool_choice "none" is rendered and the members sampled (the old qmc-serve refused `tools`), and
    # "auto" or a named tool choice get vLLM's own answers.
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"w": {"enum": ["fox", "dog", "box"]}}, "required": ["w"]}}}  # fmt: skip
    request = dict(model="tiny", messages=[{"role": "user", "content": "pick"}], n=4, max_tokens=4, tools=[tool])
    response = client(server).chat.completions.create(**request, tool_choice="none")
    assert response.model_extra["sampler"] == "lattice" and len(response.choices) == 4
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client(server).chat.completions.create(**request)  # "auto", OpenAI's default with tools
    with pytest.raises(openai.BadRequestError, match="requires --tool-call-parser"):
        named = {"type": "function", "function": {"name": "pick"}}
        client(server).chat.completions.create(**request, tool_choice=named)


def test_clients_that_disconnect_under_load_free_their_members_at_once(server):
    body = {"model": "tiny", "prompt": PROMPT, "n": 4, "max_tokens": 400, "min_tokens": 400, "stream": True}

    def stream_then_leave(_):
        with httpx.stream("POST", server["url"] + "/v1/completions", json=body, headers=auth(), timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)

    with ThreadPoolExecutor(4) as pool:  # 16 members: the server's whole capacity
        list(pool.map(stream_then_leave, range(4)))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = stats(server)
        if now["unfinished_requests"] == 0 and now["members_in_flight"] == 0:
            break
        time.sleep(0.1)
    assert (now["unfinished_requests"], now["members_in_flight"]) == (0, 0)
    # and the capacity is there again at once
    assert client(server).completions.create(model="tiny", prompt=PROMPT, n=LIMIT, max_tokens=1).choices


def completion(server, body, path="/v1/completions", headers=None):
    return httpx.post(server["url"] + path, json={"model": "tiny", **body}, headers=headers or auth(), timeout=120)


def first_tokens(response):
    return [c["token_ids"][0] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def test_stats_is_behind_the_key(server):
    for headers in ({}, auth("wrong")):
        response = httpx.get(server["url"] + "/stats", headers=headers)
        assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}
    assert stats(server)["engines"][0]["processors"] >= 1


@pytest.mark.parametrize(
    ("headers", "served"),
    [
        ([("Authorization", f"bearer {KEY}")], True),  # any case of the scheme, as vLLM
        ([("Authorization", f"BEARER {KEY}")], True),
        ([("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")], True),  # vLLM reads the first
        ([("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")], False),
        ([("Authorization", f"Basic {KEY}")], False),
    ],
)
def test_the_key_is_decided_as_vllm_decides_it_and_a_served_request_gets_its_design(server, headers, served):
    response = completion(server, {"prompt": PROMPT, "n": 2, "max_tokens": 1, "sampler_seed": 9}, headers=headers)
    assert response.status_code == (200 if served else 401), response.text
    if served:
        assert (response.json()["sampler"], response.json()["sampler_seed"]) == ("lattice", 9)


def test_a_stratified_group_of_four_billion_is_served_and_the_server_keeps_serving(server):
    huge = {"prompt": PROMPT, "n": 2, "max_tokens": 2, "return_token_ids": True}
    fields = {"sampler": "stratified", "sampler_seed": 3, "sampler_offset": 0, "sampler_group_size": 4_000_000_000}
    xargs = {"vllm_xargs": {"qmc_method": "stratified", "qmc_group": "g", "qmc_index": 0, "qmc_n": 4_000_000_000}}
    for extra in (fields, xargs):
        response = completion(server, huge | extra)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2
    for extra, param in (
        (fields | {"sampler_group_size": 2**32 + 1}, "sampler_group_size"),
        (fields | {"sampler_seed": 2**70}, "sampler_seed"),
        ({"vllm_xargs": xargs["vllm_xargs"] | {"qmc_n": 2**32 + 1}}, "vllm_xargs"),
        ({"vllm_xargs": xargs["vllm_xargs"] | {"qmc_seed": 2**70}}, "vllm_xargs"),
    ):
        response = completion(server, huge | extra)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert "must be an integer between" in response.json()["error"]["message"]
    # refused before vLLM, or by the plugin inside vLLM (members beyond qmc_n): nothing left behind
    beyond = {"n": 4, "vllm_xargs": {"qmc_method": "lattice", "qmc_group": "h", "qmc_index": 6, "qmc_n": 8}}
    assert completion(server, huge | beyond).status_code == 400
    assert completion(server, {"prompt": PROMPT, "max_tokens": 1}).status_code == 200
    now = stats(server)
    assert (now["unfinished_requests"], now["members_in_flight"]) == (0, 0)


def test_identical_prompts_in_one_request_are_groups_of_their_own(server):
    body = {"prompt": [PROMPT, PROMPT], "n": 4, "max_tokens": 8, "temperature": 1.5, "sampler_seed": 21,
            "return_token_ids": True}  # fmt: skip
    response = completion(server, body)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    ids = [tuple(c["token_ids"]) for c in choices]
    assert ids[:4] != ids[4:] and len(set(ids)) > 4, ids  # before: prompt 2's choices were prompt 1's
    # Prompt 0 is the request's seed; prompt 1 is prompt_seed(seed, 1): sent alone, the same group's first tokens.
    from qmc_sampler.vllm_plugin.request_args import prompt_seed

    alone = completion(server, body | {"prompt": PROMPT, "sampler_seed": prompt_seed(21, 1), "max_tokens": 1})
    assert first_tokens(alone) == [t[0] for t in ids[4:]]


def test_invocations_serve_completion_and_chat_bodies_with_their_design(server):
    completion_body = {"prompt": PROMPT, "n": 4, "max_tokens": 1, "sampler": "lattice", "sampler_seed": 5,
                       "return_token_ids": True}  # fmt: skip
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 1, "sampler": "lattice",
                 "sampler_seed": 5, "return_token_ids": True}  # fmt: skip
    for body, route in ((completion_body, "/v1/completions"), (chat_body, "/v1/chat/completions")):
        sagemaker = completion(server, body, "/invocations")
        assert sagemaker.status_code == 200, sagemaker.text
        assert (sagemaker.json()["sampler"], sagemaker.json()["sampler_seed"]) == ("lattice", 5)
        assert first_tokens(sagemaker) == first_tokens(completion(server, body, route))  # the same group


def test_invocations_without_the_key_are_refused_before_anything_is_generated(server):
    # vLLM guards /v1, /v2, /inference and /cohere only; qmc-serve guards /invocations too (its
    # --invocations-without-key opts out, for SageMaker-style authentication in front).
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 1, "sampler": "stratified", "sampler_seed": 4}
    before = httpx.get(server["url"] + "/stats", headers=auth(), timeout=30).json()["engines"]
    for headers in ({"Content-Type": "application/json"}, auth("wrong-key")):
        response = completion(server, body, "/invocations", headers=headers)
        assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}, response.text
    after = httpx.get(server["url"] + "/stats", headers=auth(), timeout=30).json()["engines"]
    assert [e["admitted"] for e in after] == [e["admitted"] for e in before]  # no member reached an engine
    response = completion(server, body, "/invocations", headers=auth() | {"Authorization": f"bearer {KEY}"})
    assert response.status_code == 200 and response.json()["sampler"] == "stratified", response.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses", "/invocations"])
def test_a_body_nested_deeper_than_python_parses_is_a_400(server, path):
    response = httpx.post(server["url"] + path, content=b"[" * 100_000, headers=auth(), timeout=60)
    assert response.status_code == 400, response.text
    assert completion(server, {"prompt": PROMPT, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    "path",
    ["/v1/messages", "/v1/responses", "/v1/chat/completions/batch", "/cohere/v2/chat", "/inference/v1/generate"],
)
def test_other_sampling_routes_refuse_sampler_fields_naming_the_route(server, path):
    body = {"messages": [{"role": "user", "content": "hi"}], "input": "hi", "max_tokens": 1, "sampler": "lattice"}
    response = completion(server, body, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "sampler" and f"not taken on {path}" in error["message"]


GENERATING = {  # every other route that samples, with a one-member body
    "/v1/chat/completions/batch": {"messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/inference/v1/generate": {"token_ids": [1, 70, 122], "sampling_params": {"max_tokens": 1}},
}


def test_every_generating_route_obeys_the_member_limit(server):
    # Beyond the limit in one request: the 400 of /v1/completions (conversations, or n, count as members).
    conversations = {"messages": [[{"role": "user", "content": "hi"}]] * (LIMIT + 1), "max_tokens": 1}
    generate = {"token_ids": [1, 70, 122], "sampling_params": {"n": LIMIT + 1, "max_tokens": 1}}
    for path, body in (("/v1/chat/completions/batch", conversations), ("/inference/v1/generate", generate)):
        response = completion(server, body, path)
        assert response.status_code == 400, response.text
        assert f"--max-members-in-flight={LIMIT}" in response.json()["error"]["message"]
    too_many = completion(server, {**GENERATING["/v1/responses"], "n": 129}, "/v1/responses")
    assert too_many.status_code == 400 and "--max-n" in too_many.json()["error"]["message"]
    # With the limit held by a long group, every route gets the 429 of /v1/completions.
    long = {"prompt": PROMPT, "n": LIMIT, "max_tokens": 480, "min_tokens": 480}
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(completion, server, long)
        while stats(server)["members_in_flight"] < LIMIT and not held.done():
            time.sleep(0.01)
        refused = {path: completion(server, body, path) for path, body in GENERATING.items()}
        assert held.result().status_code == 200
    for path, response in refused.items():
        assert response.status_code == 429, (path, response.text)
        assert "--max-members-in-flight" in response.json()["error"]["message"] and response.headers["Retry-After"]
    assert stats(server)["members_in_flight"] == 0
    again = {path: completion(server, body, path) for path, body in GENERATING.items()}  # room again: served
    assert {again[p].status_code for p in ("/v1/chat/completions/batch", "/v1/messages")} == {200}
    assert not {r.status_code for r in again.values()} & {400, 429}, {p: r.text for p, r in again.items()}


def test_other_sampling_routes_get_the_servers_design_through_the_drop_in(server):
    admitted = sum(e["admitted"] for e in stats(server)["engines"])
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = completion(server, body, "/v1/messages")
    assert response.status_code == 200, response.text
    assert sum(e["admitted"] for e in stats(server)["engines"]) == admitted + 1  # the plugin placed it in a group


def test_the_docs_curl_and_chat_examples_get_their_groups(server, docs, monkeypatch):
    host = server["url"].removeprefix("http://")
    curl = docs.commands("qmc-serve-key", {"localhost:8000": host, "SmolLM2-135M-Instruct": "tiny"})[1]
    done = subprocess.run(curl.expanded({"QMC_SERVE_API_KEY": KEY}), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    response = json.loads(done.stdout)
    assert len(response["choices"]) == 8 and (response["sampler"], response["sampler_seed"]) == ("lattice", 42)
    monkeypatch.setenv("QMC_SERVE_API_KEY", KEY)
    chat = docs.exec_python("qmc-serve-chat", {"http://localhost:8000": server["url"], "SmolLM2-135M-Instruct": "tiny"})
    assert len(chat["response"].choices) == 8 and isinstance(chat["seed"], int)


def test_sigterm_during_a_streaming_group_ends_cleanly(server):
    received, failures, answered = [], [], threading.Event()

    def read_stream():
        # 480 tokens with top-20 logprobs each (the model's length): still running at the SIGTERM
        body = {"model": "tiny", "prompt": PROMPT, "n": LIMIT, "max_tokens": 480, "min_tokens": 480, "logprobs": 20,
                "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", server["url"] + "/v1/completions", json=body, headers=auth(), timeout=120) as r:
                answered.set()
                for line in r.iter_lines():
                    if line:
                        received.append(line)
        except httpx.HTTPError as e:  # a body cut mid-stream
            failures.append(e)

    reader = threading.Thread(target=read_stream)
    reader.start()
    # SIGTERM as the response starts: members aborted before a token of their own (all or most of
    # them, here) get no chunk at all from vLLM.
    assert answered.wait(timeout=60)
    server["process"].send_signal(signal.SIGTERM)
    assert server["process"].wait(timeout=90) == 0
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert "qmc-serve: stopped; 0 engine requests unfinished" in server["log"].read_text()
    # The stream outlived --shutdown-timeout (0 s); its members were aborted and the body still
    # ended properly: every member's last chunk says "abort" (ours for a member without a token), then [DONE].
    assert failures == []
    assert received[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in received[:-1]]
    last = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    finished = {choice["index"]: choice["finish_reason"] for choice in last}
    assert len(last) == LIMIT  # each member ends once
    assert finished == dict.fromkeys(range(LIMIT), "abort")
