"""Model Runner V2 (vLLM's GPU default): the same class, the same groups. Needs CUDA.

Skipped without a CUDA GPU (CI has none). Where one is present it runs the tiny
model under MRV2, with and without async scheduling, and checks lattice balance,
reproducibility and equality with the reference loop.
"""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Model Runner V2 needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM not installed")

from vllm import SamplingParams

from qmc_sampler import GroupSpec, sample_group

pytestmark = [pytest.mark.vllm, pytest.mark.cuda]
PROMPT = [1, 70, 122, 35]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def gpu_llm(request, tiny_model_dir):
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from vllm import LLM

    engine = LLM(
        model=tiny_model_dir,
        dtype="float32",
        max_model_len=256,
        seed=0,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        async_scheduling=request.param,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)


def group(llm, seed, n=16, max_tokens=5, **sampling):
    params = SamplingParams(
        n=n, max_tokens=max_tokens, extra_args={"qmc_method": "lattice", "qmc_seed": seed}, **sampling
    )
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return [list(c.token_ids) for c in sorted(out.outputs, key=lambda c: c.index)]


def test_mrv2_groups_are_balanced_and_reproducible(gpu_llm, hf_model):
    with torch.no_grad():
        q = torch.softmax(hf_model(torch.tensor([PROMPT])).logits[0, -1].double(), -1).numpy()
    for seed in range(10):
        members = group(gpu_llm, seed)
        counts = np.bincount([m[0] for m in members], minlength=len(q))
        assert np.all((counts == np.floor(16 * q)) | (counts == np.ceil(16 * q))), seed
        assert members == group(gpu_llm, seed)


def test_mrv2_applies_temperature_and_top_p_itself_and_equals_the_reference(gpu_llm, hf_model):
    def next_logits(prefixes):
        with torch.no_grad():
            return torch.cat([hf_model(torch.tensor([PROMPT + p])).logits[0, -1:] for p in prefixes])

    reference = sample_group(next_logits, GroupSpec("lattice", 16, 5), 5, temperature=0.7, top_p=0.9, min_p=0.02)
    assert group(gpu_llm, 5, temperature=0.7, top_p=0.9, min_p=0.02) == reference
