"""qmc-serve's response wrapper on vLLM's own stream chunks (no server needed)."""

import asyncio
import json

import pytest
from qmc_sampler.server.fields import plan_request
from qmc_sampler.server.middleware import _Reply

import qmc_sampler

pytest.importorskip("vllm", reason="vLLM not installed")
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo

pytestmark = pytest.mark.vllm
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def completion_chunk(index, text, finish=None):
    choice = CompletionResponseStreamChoice(index=index, text=text, finish_reason=finish, stop_reason=None)
    return CompletionStreamResponse(id="cmpl-7", created=5, model="tiny", choices=[choice])


def chat_chunk(index, delta, finish=None):
    choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, finish_reason=finish)
    return ChatCompletionStreamResponse(id="chatcmpl-7", created=5, model="tiny", choices=[choice])


def usage_chunk():
    usage = UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    return CompletionStreamResponse(id="cmpl-7", created=5, model="tiny", choices=[], usage=usage)


def relay(body, chunks, chat=False, piece=37):
    """What a client reads when vLLM streams ``chunks`` (models or JSON text, then [DONE]) for ``body``,
    sent in ``piece``-byte parts."""
    plan = plan_request(body, chat=chat, default_sampler="lattice", max_n=64)
    serialised = (c if isinstance(c, str) else c.model_dump_json(exclude_unset=True) for c in chunks)
    stream = b"".join(f"data: {c}\n\n".encode() for c in serialised)
    stream += b"data: [DONE]\n\n"
    received = []

    async def send(message):
        received.append(message)

    async def run():
        reply = _Reply(send, plan)
        await reply.send({"type": "http.response.start", "status": 200, "headers": SSE})
        for at in range(0, len(stream), piece):
            await reply.send({"type": "http.response.body", "body": stream[at : at + piece], "more_body": True})
        await reply.send({"type": "http.response.body", "body": b"", "more_body": False})

    asyncio.run(run())
    body = b"".join(m.get("body", b"") for m in received[1:])
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_members_that_end_before_their_first_token_get_an_abort_chunk_before_done():
    # Two prompts × n = 3: members 0–5. vLLM sent nothing for 2, 4 and 5 (aborted before a token).
    chunks = [completion_chunk(0, "a"), completion_chunk(1, "b"), completion_chunk(3, "c"),
              completion_chunk(0, "", "length"), completion_chunk(1, "d", "abort"),
              completion_chunk(3, "", "abort")]  # fmt: skip
    events = relay({"prompt": ["x", "y"], "n": 3, "stream": True, "sampler_seed": 2, "logprobs": 0}, chunks)
    # Every chunk names its group: design, seed and the release that drew it (same seed + release, same group).
    ours = {"sampler": "lattice", "sampler_seed": 2, "sampler_release": qmc_sampler.__version__}
    assert events[: len(chunks)] == [ours | c.model_dump(exclude_unset=True) for c in chunks]
    added = events[len(chunks) :]
    assert [e["choices"][0]["index"] for e in added] == [2, 4, 5]
    for event in added:
        CompletionStreamResponse.model_validate(event)  # vLLM's own shape
        assert event["sampler"] == "lattice" and event["sampler_seed"] == 2
        assert event["sampler_release"] == qmc_sampler.__version__
        assert (event["id"], event["created"], event["model"], event["object"]) == ("cmpl-7", 5, "tiny",
                                                                                   "text_completion")  # fmt: skip
        no_tokens = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}  # as vLLM's aborts
        assert event["choices"][0] | {"index": 0} == {"index": 0, "text": "", "logprobs": no_tokens,
                                                      "finish_reason": "abort", "stop_reason": None}  # fmt: skip


def test_the_abort_chunks_come_before_the_usage_chunk():
    chunks = [completion_chunk(0, "a", "length"), usage_chunk()]
    events = relay({"prompt": "x", "n": 3, "stream": True, "stream_options": {"include_usage": True}}, chunks)
    assert [e["choices"][0]["index"] if e["choices"] else "usage" for e in events] == [0, 1, 2, "usage"]
    assert events[1]["choices"][0]["logprobs"] is None  # none asked for


def test_a_chat_member_that_only_got_its_role_chunk_is_finished_with_an_abort():
    role = [chat_chunk(i, {"role": "assistant", "content": ""}) for i in range(4)]
    chunks = [*role, chat_chunk(1, {"content": "hi"}), chat_chunk(1, {}, "stop"), chat_chunk(3, {}, "length")]
    body = {"messages": [{"role": "user", "content": "x"}], "n": 4, "stream": True, "logprobs": True}
    added = relay(body, chunks, chat=True)[len(chunks) :]
    assert [e["choices"][0]["index"] for e in added] == [0, 2]
    for event in added:
        ChatCompletionStreamResponse.model_validate(event)
        assert event["object"] == "chat.completion.chunk" and event["id"] == "chatcmpl-7"
        assert event["choices"][0]["delta"] == {} and event["choices"][0]["finish_reason"] == "abort"
        assert event["choices"][0]["logprobs"] == {"content": []}


@pytest.mark.parametrize("piece", [1, 37, 10_000])
def test_a_stream_whose_members_all_finished_is_passed_on_unchanged(piece):
    chunks = [completion_chunk(i, "tok") for i in range(2)] + [completion_chunk(i, "", "stop") for i in range(2)]
    events = relay({"prompt": "x", "n": 2, "stream": True}, chunks, piece=piece)
    assert [{k: v for k, v in e.items() if not k.startswith("sampler")} for e in events] == [
        c.model_dump(exclude_unset=True) for c in chunks
    ]


def test_nothing_is_added_after_an_error_event():
    error = ErrorResponse(error=ErrorInfo(message="boom", type="InternalServerError", code=500))
    events = relay({"prompt": "x", "n": 2, "stream": True}, [completion_chunk(0, "a"), json.dumps(error.model_dump())])
    assert len(events) == 2 and "error" in events[1]


def through_the_middleware(path: str, body: dict, headers=(), root_path: str = "", without_key_flag: bool = False,
                           held: int = 0):  # fmt: skip
    """POST ``body`` to ``path`` through qmc-serve's middleware over a stand-in for vLLM's app, on a server
    with an API key and a limit of 8 members, ``held`` of them already in flight: (the ASGI messages sent,
    whether the request reached vLLM's app). Whatever happened, the request's members were given back."""
    from types import SimpleNamespace

    from qmc_sampler.server.middleware import QMCServeMiddleware

    reached = []

    async def vllm_app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"choices": []}', "more_body": False})

    args = SimpleNamespace(api_key=["k3y"], api_server_count=1, max_members_in_flight=8, queue_timeout=0.0,
                           max_body_bytes=1 << 16, sampler="lattice", max_n=8,
                           invocations_without_key=without_key_flag)  # fmt: skip
    app = SimpleNamespace(state=SimpleNamespace(args=args, engine_client=None))
    scope = {"type": "http", "method": "POST", "path": root_path.rstrip("/") + path, "root_path": root_path,
             "app": app, "headers": [(b"content-type", b"application/json"), *headers]}  # fmt: skip
    sent = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    async def run():
        middleware = QMCServeMiddleware(vllm_app)
        limiter = middleware._server(scope).limiter
        if held:
            await limiter.acquire(held)
        await middleware(scope, receive, send)
        return limiter.in_flight

    assert asyncio.run(run()) == held
    return sent, bool(reached)


def post_through_the_middleware(path: str, headers=(), root_path: str = "", without_key_flag: bool = False):
    """A one-token completion through :func:`through_the_middleware`: (status, whether vLLM's app was reached)."""
    sent, reached = through_the_middleware(path, {"model": "tiny", "prompt": "hi", "max_tokens": 1}, headers,
                                           root_path, without_key_flag)  # fmt: skip
    return sent[0]["status"], reached


KEY = [(b"authorization", b"Bearer k3y")]


@pytest.mark.parametrize("root_path", ["", "/", "/inv", "/api"])
@pytest.mark.parametrize("path", ["/invocations", "/generative_scoring", "/v1/completions", "/v1/responses"])
def test_nothing_generates_without_the_key_whatever_the_root_path(path, root_path):
    # "/" and "/inv" are root paths under which a plain prefix cut would misread the route
    # (vLLM's own check misses "/v1" under "/").
    assert post_through_the_middleware(path, (), root_path) == (401, False)
    assert post_through_the_middleware(path, [(b"authorization", b"Bearer nope")], root_path) == (401, False)
    assert post_through_the_middleware(path, KEY, root_path) == (200, True)


def test_invocations_alone_are_open_when_the_server_opts_out():
    assert post_through_the_middleware("/invocations", without_key_flag=True) == (200, True)  # authenticated in front
    assert post_through_the_middleware("/generative_scoring", without_key_flag=True) == (401, False)


def post_body(path: str, body: dict, held: int = 0):
    """POST ``body`` to ``path`` with the key (:func:`through_the_middleware`): (status, error message or
    None, whether vLLM's stand-in app was reached)."""
    sent, reached = through_the_middleware(path, body, KEY, held=held)
    error = json.loads(sent[-1]["body"]).get("error") if sent[0]["status"] != 200 else None
    return sent[0]["status"], error and error["message"], reached


CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions/batch", {"messages": [CONVERSATION] * 3}),
        ("/v1/responses", {"input": "hi", "n": 3}),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 3}}),
        ("/generative_scoring", {"query": "q", "items": ["a", "b", "c"]}),
        ("/v1/completions", {"prompt": ["a", "b", "c"]}),
    ],
)
def test_every_generating_route_counts_its_members_against_the_limit(path, body):
    assert post_body(path, body)[0] == 200
    status, message, reached = post_body(path, body, held=6)  # 3 members, 2 free: the 429 of /v1/completions
    assert (status, reached) == (429, False) and "--max-members-in-flight" in message
    status, message, reached = post_body(path, body, held=5)  # they fit exactly
    assert (status, reached) == (200, True)


@pytest.mark.parametrize("path", ["/v1/chat/completions/batch", "/v1/responses", "/v1/messages"])
def test_n_beyond_max_n_is_refused_on_every_route(path):
    status, message, reached = post_body(path, {"messages": [CONVERSATION], "input": "hi", "n": 9})
    assert (status, reached) == (400, False) and "--max-n" in message


def test_the_token_routes_sampling_params_n_is_bounded_and_counted_whatever_the_top_level_n_says():
    from qmc_sampler.server.fields import FieldError, plan_other_route

    with pytest.raises(FieldError, match="--max-n"):
        plan_other_route("/inference/v1/generate", {"n": 1, "sampling_params": {"n": 1000}}, max_n=8)
    with pytest.raises(FieldError, match="--max-n"):
        plan_other_route("/inference/v1/generate", {"n": 1000, "sampling_params": {"n": 1}}, max_n=8)


def test_a_callers_group_numbered_by_arrival_is_planned_onto_one_engine_on_every_route():
    from qmc_sampler.server.fields import LEAST_LOADED, plan_other_route, plan_request

    def xargs(group, **more):
        return {"qmc_method": "lattice", "qmc_group": group, "qmc_n": 8, **more}

    def planned(group, prompt, **more):
        return plan_request({"prompt": prompt, "vllm_xargs": xargs(group, **more)}, chat=False,
                            default_sampler="lattice", max_n=8).placement  # fmt: skip

    same = {planned("g", p) for p in ("a", "b", "c")}  # whatever the prompt: the group's engine
    assert len(same) == 1 and None not in same and LEAST_LOADED not in same
    assert planned("h", "a") not in same
    other = plan_other_route("/v1/chat/completions/batch", {"messages": [CONVERSATION], "vllm_xargs": xargs("g")},
                             max_n=8)  # fmt: skip
    assert {other.placement} == same
    assert planned("g", "a", qmc_index=3) is None  # an explicit member: any engine
