"""``qmc-serve`` end to end: a real server process on loopback, the official ``openai`` client."""

import json
import os
import time

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.vllm
PROMPT = "the quick brown"


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("qmc-serve") / "server.log"


@pytest.fixture(scope="module")
def base_url(tiny_model_dir, serve, server_log, docs):
    (qmc_serve,) = docs.commands("readme-qmc-serve", {"path/to/model": tiny_model_dir})  # the README's recipe
    command = [*qmc_serve.argv, "--served-model-name", "tiny", "--max-n", "64", "--kv-cache-gb", "1",
               "--max-num-seqs", "32", "--enable-prefix-caching"]  # any vllm serve option  # fmt: skip
    # INFO: the test below reads vLLM's start-up line (TRL's import, earlier in a session, sets ERROR).
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    with serve(command, server_log, env) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def texts(response):
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


def test_the_readme_openai_sdk_example_gets_one_group(base_url, docs):
    example = docs.exec_python("readme-openai", {"http://localhost:8000": base_url, "path/to/model": "tiny"})
    assert len(example["response"].choices) == 8 and example["response"].model_extra["sampler"] == "lattice"


def test_models_health_and_stats(client, base_url):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{base_url}/health").status_code == 200
    stats = httpx.get(f"{base_url}/stats").json()
    assert stats["members_in_flight"] == 0 and stats["engines"][0]["processors"] == 1


def test_every_vllm_serve_option_is_taken(base_url, server_log, warm_python):
    # The fixture's server was started with vLLM's --max-num-seqs and --enable-prefix-caching.
    assert "'max_num_seqs': 32" in server_log.read_text() and "'enable_prefix_caching': True" in server_log.read_text()
    shown = warm_python.run(["-m", "qmc_sampler.server.main", "--help=all"], timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    for option in ("--tensor-parallel-size", "--gpu-memory-utilization", "--quantization", "--enable-lora",
                   "--sampler", "--max-members-in-flight"):  # fmt: skip
        assert option in shown.stdout, option


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


def test_chat_with_n8_and_the_models_own_logprobs(client, hf_model, tiny_model_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hello"}]
    response = client.chat.completions.create(
        model="tiny", messages=messages, n=8, max_tokens=3, seed=11, logprobs=True, top_logprobs=2
    )
    assert sorted(c.index for c in response.choices) == list(range(8))
    assert all(c.message.role == "assistant" for c in response.choices)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with torch.no_grad():
        model = torch.log_softmax(hf_model(torch.tensor([tokenizer.encode(text)])).logits[0, -1].double(), -1)
    top2 = torch.topk(model, 2).values.tolist()
    by_text: dict[str, list[float]] = {}
    for token_id, value in enumerate(model.tolist()):
        by_text.setdefault(tokenizer.decode([token_id]), []).append(value)
    for choice in response.choices:
        first = choice.logprobs.content[0]
        # exactly 2, the model's (in vLLM's order: the sampled token first where it is among them)
        assert sorted((t.logprob for t in first.top_logprobs), reverse=True) == pytest.approx(top2, abs=1e-3)
        assert any(abs(first.logprob - v) < 1e-3 for v in by_text[first.token])  # the sampled token's own
        assert all(len(p.top_logprobs) == 2 for p in choice.logprobs.content)
    again = client.chat.completions.create(model="tiny", messages=messages, n=8, max_tokens=3, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in response.choices]


def test_the_group_seed_reproduces_the_group(client):
    a = client.completions.create(model="tiny", prompt=PROMPT, n=8, max_tokens=5)
    seed = a.model_extra["sampler_seed"]
    b = client.completions.create(model="tiny", prompt=PROMPT, n=8, max_tokens=5, extra_body={"sampler_seed": seed})
    assert texts(a) == texts(b)


def test_extended_groups_equal_one_big_group(client):
    def first_tokens(**extra):
        response = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=5, logprobs=1, extra_body={"sampler": "lattice", "sampler_seed": 9}
            | extra.pop("body", {}), **extra,
        )  # fmt: skip
        return [c.logprobs.tokens[0] for c in sorted(response.choices, key=lambda c: c.index)]

    whole = first_tokens(n=16)
    first = first_tokens(n=8, body={"sampler_group_size": 16})
    second = first_tokens(n=8, body={"sampler_offset": 8, "sampler_group_size": 16})
    # Members 0-7 and 8-15 of the 16-member group: the same codes, so the same first tokens (whole
    # texts only where a row's logits do not depend on its batch, which differs here: 16 rows vs 8).
    assert first + second == whole
    assert len(set(whole)) > 1


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


def test_chat_streams_carry_the_same_logprobs_as_whole_responses(client):
    request = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, logprobs=True,
                   top_logprobs=2, extra_body={"sampler_seed": 4})  # fmt: skip
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.logprobs.content if choice.logprobs else []
    whole = client.chat.completions.create(**request)
    for choice in whole.choices:
        assert len(choice.logprobs.content) == 4
        assert [(t.token, t.logprob, [x.logprob for x in t.top_logprobs]) for t in streamed[choice.index]] == [
            (t.token, t.logprob, [x.logprob for x in t.top_logprobs]) for t in choice.logprobs.content
        ]


def _vllm_release() -> tuple[int, ...]:
    import vllm

    return tuple(int(part) for part in vllm.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(
    _vllm_release() < (0, 32),
    reason="vLLM < 0.32 advances a stream's text_offset by each chunk's "
    "delta text, not by the tokens it reports (vLLM's own serving code; changed in 0.32)",
)
def test_streamed_text_offsets_keep_counting_across_chunks(client):
    stream = client.completions.create(model="tiny", prompt=PROMPT, n=1, max_tokens=8, logprobs=1, stream=True,
                                       extra_body={"min_tokens": 8})  # fmt: skip
    offsets, tokens = [], []
    for chunk in stream:
        for choice in chunk.choices:
            offsets += choice.logprobs.text_offset
            tokens += choice.logprobs.tokens
    # Each token's offset is where it starts in the completion's text (not 0 again in every chunk).
    assert len(offsets) == 8 and offsets == [sum(map(len, tokens[:i])) for i in range(8)]


def test_a_client_that_disconnects_mid_stream_frees_the_engine(base_url, server_log):
    # 32 members × 480 tokens with logprobs take ~10 s here; the client leaves after the first
    # chunk. The response must end at once (its log line's latency, measured by the server), and
    # the engine and the member limit must be empty again — whenever the client got to leave.
    body = {"model": "tiny", "prompt": PROMPT, "n": 32, "max_tokens": 480, "min_tokens": 480, "logprobs": 5,
            "stream": True}  # fmt: skip
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: {"))
    request_id = json.loads(first.removeprefix("data: "))["id"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = httpx.get(f"{base_url}/stats").json()
        lines = [json.loads(x) for x in server_log.read_text().splitlines() if x.startswith('{"event": "request"')]
        mine = [x for x in lines if x["id"] == request_id]
        if mine and (stats["unfinished_requests"], stats["members_in_flight"]) == (0, 0):
            break
        time.sleep(0.1)
    assert mine and mine[0]["latency_s"] < 5.0, mine  # aborted, not run to its end
    assert (stats["unfinished_requests"], stats["members_in_flight"]) == (0, 0), stats


# qmc-serve's own fields: a 400 in OpenAI's shape naming the field.
OURS = [
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"n": "two"}, "n"),
    ({"sampler": "lattic"}, "sampler"),
    ({"temperature": 0.0, "sampler": "lattice"}, "temperature"),
    ({"sampler_offset": 4}, "sampler_group_size"),
    ({"sampler_offset": 4, "sampler_group_size": 8, "n": 8}, "sampler_group_size"),
    ({"sampler_offset": 4, "sampler_group_size": 8}, "sampler_seed"),  # extending a group needs its seed
    ({"sampler_seed": "x"}, "sampler_seed"),
    ({"vllm_xargs": {"qmc_method": "lattic"}}, "vllm_xargs"),
    ({"vllm_xargs": {"qmc_index": 1}}, "vllm_xargs"),
    ({"vllm_xargs": {"qmc_group": "g", "qmc_n": 4}, "sampler_offset": 1, "sampler_group_size": 4}, "vllm_xargs"),
    ({"use_beam_search": True}, "use_beam_search"),  # beam search does not sample: no design applies
]
# vLLM's own validation: a 400 whose param or message names what is wrong.
VLLMS = [
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": 123}, "stop"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3.0}, "temperature"),  # vLLM 0.32's SamplingParams allows [0, 2]
    ({"top_p": 0.0}, "top_p"),
    ({"logprobs": 99}, "logprobs"),
    ({"vllm_xargs": {"nested": {"a": 1}}}, "vllm_xargs"),
    ({"prompt": [10_000_000]}, "out of vocabulary"),
    ({"prompt": [[1, 2], [3, -1]]}, "prompt"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"suffix": "!"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [99999]}, "stop_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
]
VLLMS_CHAT = [
    ({"messages": []}, "conversation"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "multimodal"),
    ({"messages": [{"role": "user"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages }}"}, "chat template"),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, "continue_final_message"),
]
# What the old qmc-serve refused and vLLM serves (its extensions): accepted now.
VLLM_EXTENSIONS = [{"echo": True}, {"prompt_logprobs": 1}, {"truncate_prompt_tokens": 2}, {"logit_bias": {"5": 200}},
                   {"temperature": 2.0}]  # fmt: skip


def assert_our_error(response, param):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def assert_vllms_error(response, named):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in f"{error.get('param')} {error['message']}", error


@pytest.mark.parametrize(("fields", "param"), OURS)
def test_bad_sampler_fields_are_a_400_in_openai_shape_naming_the_field(base_url, fields, param):
    assert_our_error(httpx.post(f"{base_url}/v1/completions", json={"model": "tiny", "prompt": PROMPT} | fields), param)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert_our_error(httpx.post(f"{base_url}/v1/chat/completions", json=chat | fields), param)


@pytest.mark.parametrize(("fields", "named"), VLLMS)
def test_the_rest_of_the_body_is_validated_by_vllm(base_url, fields, named):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2} | fields
    assert_vllms_error(httpx.post(f"{base_url}/v1/completions", json=body), named)


@pytest.mark.parametrize(("fields", "named"), VLLMS_CHAT)
def test_chat_bodies_are_validated_by_vllm(base_url, fields, named):
    assert_vllms_error(httpx.post(f"{base_url}/v1/chat/completions", json={"model": "tiny"} | fields), named)


@pytest.mark.parametrize("fields", VLLM_EXTENSIONS)
def test_what_vllm_accepts_is_served(client, fields):
    response = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=3, extra_body=fields)
    assert len(response.choices) == 2 and response.model_extra["sampler"] == "lattice"


def test_an_unknown_model_is_a_404_naming_the_model(base_url, client):
    for path, body in (
        ("completions", {"prompt": PROMPT}),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        response = httpx.post(f"{base_url}/v1/{path}", json={"model": "no-such-model"} | body)
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)


def test_best_of_equal_to_n_and_logit_bias_are_served(client, tiny_model_dir):
    from transformers import AutoTokenizer

    same = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=3, extra_body={"best_of": 2})
    assert len(same.choices) == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (fox,) = tokenizer.encode(" fox")  # a whole-word token: its text decodes on its own
    biased = client.completions.create(
        model="tiny", prompt=PROMPT, n=4, max_tokens=1, logprobs=1, logit_bias={str(fox): 100}
    )
    token = tokenizer.decode([fox])
    assert [c.logprobs.tokens[0] for c in biased.choices] == [token] * 4


def test_vllms_sampling_extensions_are_served_not_ignored(client, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (fox,) = tokenizer.encode(" fox")

    def sample(favoured, **fields):
        response = client.completions.create(
            model="tiny", prompt=PROMPT, n=4, max_tokens=8, logit_bias=dict.fromkeys(map(str, favoured), 100),
            extra_body={"return_token_ids": True, **fields},
        )  # fmt: skip
        choices = sorted(response.choices, key=lambda c: c.index)
        return [(len(c.model_extra["token_ids"]), c.finish_reason) for c in choices], choices

    # The favoured token is drawn at once and stops the member; min_tokens holds the stop back.
    assert sample([fox], stop_token_ids=[fox])[0] == [(1, "stop")] * 4
    assert sample([fox], stop_token_ids=[fox], min_tokens=3)[0] == [(4, "stop")] * 4
    only, choices = sample([fox], allowed_token_ids=[fox])
    assert only == [(8, "length")] * 4 and {t for c in choices for t in c.model_extra["token_ids"]} == {fox}
    # vLLM bans a bad word with and without a leading space ("the" and " the" are one token each here).
    the = [*tokenizer.encode("the"), *tokenizer.encode(" the")]
    _, favoured = sample(the)
    _, banned = sample(the, bad_words=["the"])
    assert {t for c in favoured for t in c.model_extra["token_ids"]} <= set(the)
    assert not {t for c in banned for t in c.model_extra["token_ids"]} & set(the)


def test_chat_template_options_shape_the_prompt_as_in_vllm(client):
    def prompt_tokens(messages, **fields):
        response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body=fields)
        return response.usage.prompt_tokens

    user = [{"role": "user", "content": "the quick brown"}]
    with_prompt = prompt_tokens(user)
    without = prompt_tokens(user, add_generation_prompt=False)
    assert with_prompt > without  # the template's "<|assistant|>" is left out
    # Continuing the assistant's message leaves its end-of-turn out.
    partial = [*user, {"role": "assistant", "content": "fox"}]
    closed = prompt_tokens(partial, add_generation_prompt=False)
    assert prompt_tokens(partial, add_generation_prompt=False, continue_final_message=True) < closed


def test_lm_eval_repeats_are_one_balanced_group_as_on_vllms_server(base_url, hf_model, tiny_model_dir, tmp_path,
                                                                    lm_eval_repeats):  # fmt: skip
    # lm-eval sends each repeat as its own n = 1 request with seed 1234: the drop-in's auto group,
    # members 0..15 (before, qmc-serve made every repeat member 0 of the group seeded 1234: 16 copies).
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed")
    from transformers import AutoTokenizer

    (grouped,) = lm_eval_repeats.run(f"{base_url}/v1", tmp_path, "qmc_serve_repeats")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokenizer.encode("the quick brown")])).logits[0, -1]
    q = torch.softmax(logits.double() / 1.5, -1).numpy()
    assert lm_eval_repeats.unbalanced(grouped, q, tokenizer) == {}, grouped
    assert len(set(grouped)) > 4


def test_seeded_n1_repeats_are_the_next_members_and_an_offset_needs_a_seed(client):
    seeded = [
        client.completions.create(model="tiny", prompt="pack my box", max_tokens=6, temperature=1.5, seed=77)
        for _ in range(6)
    ]
    assert len({r.choices[0].text for r in seeded}) >= 3  # one text six times before
    assert {r.model_extra["sampler_seed"] for r in seeded} == {77}
    with pytest.raises(openai.BadRequestError, match="sampler_seed"):
        client.completions.create(
            model="tiny", prompt="pack my box", max_tokens=2, extra_body={"sampler_offset": 2, "sampler_group_size": 8}
        )
