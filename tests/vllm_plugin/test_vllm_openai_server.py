"""The plugin behind vLLM's own OpenAI server, driven by the official ``openai`` client.

The server is started exactly as the README's recipe says (``--logits-processors``
is optional: the installed entry point already loads the processor).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tiny_model_dir, http_helpers, tmp_path_factory):
    free_port, wait_for_http = http_helpers
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm-server") / "server.log", "w")
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            tiny_model_dir,
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--logits-processors",
            "qmc_sampler.vllm_plugin:QMCLogitsProcessor",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", process)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


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
