"""qmc-serve when the plugin's draw fails: never a design's name on samples vLLM drew itself.

* A server whose fused backend raises at every call — ``QMC_SAMPLER_BACKEND=triton`` on a machine
  without a GPU (no Triton device): every draw raises inside ``qmc_sampler.kernels``, as a kernel
  built for another torch or a Triton compile error would — serves exact groups on the pure-torch
  path: a designed ``n = 8`` group equals the reference loop's, ``/stats`` says which backend draws
  and why, and the log holds one traceback.
* Once a worker stopped drawing (its draw failed on every backend), a designed request is a 400
  naming why, on qmc-serve's routes (the middleware, with vLLM's app stood in for).
"""

import asyncio
import json
import os
import sys
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.server.middleware import QMCServeMiddleware
from qmc_sampler.vllm_engine import checks

from qmc_sampler import GroupSpec, sample_group

pytestmark = pytest.mark.vllm
PROMPT = [1, 70, 122, 35]


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve, tmp_path_factory):
    """qmc-serve with a fused backend that cannot draw; yields (base url, log path)."""
    log = tmp_path_factory.mktemp("draw-failures") / "server.log"
    command = [sys.executable, "-m", "qmc_sampler.server.main", "--model", tiny_model_dir, "--served-model-name",
               "tiny", "--kv-cache-gb", "1", "--max-model-len", "64"]  # fmt: skip
    # INFO: the test reads the plugin's lines (TRL's import, earlier in a session, sets ERROR).
    env = os.environ | {"QMC_SAMPLER_BACKEND": "triton", "VLLM_LOGGING_LEVEL": "INFO"}
    env.pop("TRITON_INTERPRET", None)
    with serve(command, log, env) as (_, url):
        yield url, log


def test_a_backend_that_raises_at_every_call_still_serves_exact_groups_with_one_traceback(server, hf_model):
    import torch
    from transformers import AutoTokenizer

    url, log = server
    body = {"model": "tiny", "prompt": PROMPT, "n": 8, "max_tokens": 5, "min_tokens": 5, "sampler_seed": 5,
            "return_token_ids": True}  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    assert reply["sampler"] == "lattice"
    tokens = [c["token_ids"] for c in sorted(reply["choices"], key=lambda c: c["index"])]

    def next_logits(prefixes):
        with torch.no_grad():
            return torch.cat([hf_model(torch.tensor([PROMPT + p])).logits[0, -1:] for p in prefixes])

    eos = AutoTokenizer.from_pretrained(hf_model.name_or_path).eos_token_id
    reference = sample_group(next_logits, GroupSpec("lattice", 8, 5), 5, eos_token_id=eos)
    assert [t[0] for t in tokens] == [r[0] for r in reference]  # the lattice's own first tokens, not vLLM's draws
    (engine,) = httpx.get(f"{url}/stats", timeout=60).json()["engines"]
    assert engine["draw_backend"] == "torch" and engine["draw_failed_rows"] == 0, engine
    assert engine["draw_fallback"].startswith("the triton backend's draw failed 3 steps in a row (ValueError: "), engine
    assert engine["drawn"] >= 8 * 5 + 1  # the group, and the start-up check's designed token
    text = log.read_text()
    assert text.count("Traceback (most recent call last)") == 1, text[-3000:]
    assert text.count("draws on the pure-torch path from now on") == 1


def post(middleware, body):
    """POST ``body`` to /v1/completions through ``middleware``: (status, the error message or None)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "app": APP,
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    asyncio.run(middleware(scope, receive, send))
    error = json.loads(sent[-1]["body"]).get("error") if sent[0]["status"] != 200 else None
    return sent[0]["status"], error and error["message"]


async def vllm_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"choices": []}', "more_body": False})


ARGS = SimpleNamespace(api_key=None, api_server_count=1, max_members_in_flight=8, queue_timeout=0.0,
                       max_body_bytes=1 << 16, sampler="lattice", max_n=8, invocations_without_key=False)  # fmt: skip
APP = SimpleNamespace(state=SimpleNamespace(args=ARGS, engine_client=None))


def test_designed_requests_are_refused_once_a_worker_stopped_drawing():
    middleware = QMCServeMiddleware(vllm_app)
    # This process is the server's worker here: it records, as a worker does, that it stopped drawing.
    middleware._server({"app": APP}).workers = (os.getpid(),)
    designed = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "n": 2}
    assert post(middleware, designed) == (200, None)
    remove = checks.record_broken_draws("its draw failed 3 steps in a row (RuntimeError: no kernel)")
    try:
        status, message = post(middleware, designed)
        assert status == 400 and "sampler 'lattice' is unavailable" in message, message
        assert f"worker pid {os.getpid()}: its draw failed 3 steps in a row (RuntimeError: no kernel)" in message
        assert post(middleware, designed | {"temperature": 0.0}) == (200, None)  # greedy: no design to refuse
    finally:
        remove()
    assert post(middleware, designed) == (200, None)
