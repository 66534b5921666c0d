"""A request whose row has no inverse CDF never takes a server down (vLLM's own server with the
drop-in; qmc-serve is that server with a middleware in front).

Two kinds of such rows: every token masked by the request's own constraints
(``allowed_token_ids`` = [X] and ``bad_words`` = [X's text]), and NaN logits. The
model is the tiny Llama with one token's embedding set to NaN, so any prompt that
contains that token has NaN logits at every position after it. The server must
answer the request (200 or a 4xx), log the plugin's warning, and then serve the
next 20 requests, designed or not.
"""

import os
import sys
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM not installed")

pytestmark = pytest.mark.vllm
POISON_WORD = "zebras"


@pytest.fixture(scope="module")
def nan_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with the embedding of POISON_WORD's token set to NaN; returns (dir, that token id)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("nan-llama")
    shutil.copytree(tiny_model_dir, directory, dirs_exist_ok=True)
    token = AutoTokenizer.from_pretrained(directory).encode(POISON_WORD)[-1]
    weights = load_file(directory / "model.safetensors")
    weights["model.embed_tokens.weight"][token] = torch.nan
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return str(directory), token


@pytest.fixture(scope="module")
def masked(nan_model):
    """(allowed_token_ids, bad_words) that together leave no admissible token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(nan_model[0])
    token = tokenizer.encode("fox")[-1]
    return [token], [tokenizer.decode([token])]


def vllm_server_command(model):
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
            "tiny", "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32",
            "--max-model-len", "256"]  # fmt: skip


@pytest.fixture(scope="module")
def server(nan_model, serve, tmp_path_factory):
    """The server on the NaN model; yields (base url, log path, process)."""
    log = tmp_path_factory.mktemp("unsampleable") / "server.log"
    # The test reads the plugin's warning from the log: unbuffered, and at vLLM's INFO level (importing
    # TRL earlier in the session sets VLLM_LOGGING_LEVEL=ERROR in this process's environment).
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "QMC_SAMPLER": "lattice", "PYTHONUNBUFFERED": "1",
                        "VLLM_LOGGING_LEVEL": "INFO"}  # fmt: skip
    with serve(vllm_server_command(nan_model[0]), log, env) as (process, url):
        yield url, log, process


def complete(url, **body):
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=120)


def assert_serves_20_more(url, process):
    for i in range(20):
        extra = {"vllm_xargs": {"qmc_method": "lattice"}} if i % 2 else {}
        response = complete(url, prompt="the quick brown", n=4, max_tokens=4, temperature=1.5, **extra)
        assert response.status_code == 200, (i, response.text)
        assert len(response.json()["choices"]) == 4
    assert process.poll() is None


WARNING = "its logits are NaN or all -inf"


def warned_more_than(log, before: int, timeout: float = 20.0) -> bool:
    """Whether the plugin's warning appears more than ``before`` times in ``log`` within ``timeout`` s
    (another process writes it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.read_text().count(WARNING) > before:
            return True
        time.sleep(0.2)
    return False


def test_a_request_that_masks_every_token_is_answered_and_the_server_lives_on(server, masked):
    url, log, process = server
    allowed, bad = masked
    body = {"prompt": "the quick brown", "max_tokens": 4, "temperature": 1.5, "allowed_token_ids": allowed,
            "bad_words": bad}  # fmt: skip
    warned = log.read_text().count(WARNING)
    designed = complete(url, **body, n=4, vllm_xargs={"qmc_method": "iid"})
    assert designed.status_code == 200 or 400 <= designed.status_code < 500, designed.text
    assert warned_more_than(log, warned)  # the rows were reached, and left to the engine
    # the same request without a design (qmc_auto_group=0 keeps the drop-in off)
    plain = complete(url, **body, vllm_xargs={"qmc_auto_group": 0})
    assert plain.status_code == designed.status_code, (plain.text, designed.text)
    assert_serves_20_more(url, process)


def test_a_prompt_with_nan_logits_is_answered_and_the_server_lives_on(server):
    url, log, process = server
    warned = log.read_text().count(WARNING)
    response = complete(url, prompt=f"how vexingly quick daft {POISON_WORD} jump", n=4, max_tokens=4,
                        temperature=1.5, vllm_xargs={"qmc_method": "lattice"})  # fmt: skip
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
    assert warned_more_than(log, warned)
    assert_serves_20_more(url, process)
