"""transformers' ``generate`` on a CUDA GPU with ``QMCGenerate`` (``make gpu-check``): the tiny random
Llama on the GPU, logits and the forcer's draws on the device (the Triton kernel), each member an
exact draw of transformers' own processed distribution, every lattice group balanced.

Skipped without CUDA. ``QMC_GPU_CHECK_DEVICE=cpu`` (``gpu_check.sh``'s dry run) runs them on the CPU
with fewer groups. Statistical tests: family-wise α = 1e-3, Bonferroni over every per-member test in
this file (:data:`TESTS`).
"""

import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from qmc_sampler.hf import QMCGenerate  # noqa: E402

#: Where these tests run: CUDA (skipped without it), or the CPU for gpu_check.sh's dry run.
DEVICE = torch.device(os.environ.get("QMC_GPU_CHECK_DEVICE", "cuda"))
ON_GPU = DEVICE.type == "cuda"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

T = 1.5
G = 8
GROUPS = 300 if ON_GPU else 30
SETTINGS = {
    "hf-default-top-k-50": {"temperature": T},
    "top-p-and-min-p": {"temperature": T, "top_k": 0, "top_p": 0.9, "min_p": 0.05},
}
TESTS = 2 * G + G  # two settings' first tokens, the two-token test
ALPHA = 1e-3 / TESTS


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(DEVICE).eval()


@pytest.fixture(scope="module")
def inputs(tiny_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    return {k: v.to(DEVICE) for k, v in tok(["the quick brown"], return_tensors="pt").items()}


def hf_probs(model, inputs, **settings) -> np.ndarray:
    """transformers' processed next-token distribution of each row (``output_scores``): ``[rows, vocab]``
    float64 on the host. No row ends here (``min_new_tokens``), as in :func:`generate_groups`."""
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=True, max_new_tokens=1, min_new_tokens=1, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, **settings)  # fmt: skip
    return torch.softmax(out.scores[0].double(), -1).cpu().numpy()


def generate_groups(model, inputs, generator, new_tokens, **settings) -> np.ndarray:
    """:data:`GROUPS` calls with ``num_return_sequences=G``: ``[GROUPS, G, new_tokens]`` (no row ends early:
    ``min_new_tokens`` masks the end-of-sequence token, in :func:`hf_probs`' reference too)."""
    width = inputs["input_ids"].shape[1]
    out = []
    for _ in range(GROUPS):
        with torch.no_grad():
            seq = model.generate(**inputs, do_sample=True, num_return_sequences=G, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=0, custom_generate=generator,
                                 **settings)  # fmt: skip
        assert seq.device.type == DEVICE.type
        out.append(seq[:, width:].cpu().numpy())
    assert generator.stats.unsampleable == 0
    return np.stack(out)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_on_the_device_each_member_is_exact_and_every_lattice_group_balanced(
    model, inputs, setting, balanced, chi_square_p
):
    q = hf_probs(model, inputs, **SETTINGS[setting])[0]
    assert q.max() < 0.7 and (q > 0).sum() > 5  # flat enough for the tests to have power
    first = generate_groups(model, inputs, QMCGenerate("lattice", seed=1), 1, **SETTINGS[setting])[:, :, 0]
    assert all(balanced(group, q) for group in first)
    for member in range(G):
        assert chi_square_p(first[:, member], q) > ALPHA, (setting, member)


def test_on_the_device_the_carry_keeps_the_second_token_exact(model, inputs, chi_square_p):
    q1 = hf_probs(model, inputs, temperature=T)[0]
    pairs = generate_groups(model, inputs, QMCGenerate("lattice", seed=3), 2, temperature=T)
    vocab = len(q1)
    # q(a, b) = q1(a) · q2(b | a), q2 from transformers on the prompt + a: every a in one batch.
    firsts = np.flatnonzero(q1 > 0)
    ids = torch.cat([inputs["input_ids"].expand(len(firsts), -1), torch.tensor(firsts, device=DEVICE)[:, None]], 1)
    q2 = hf_probs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, temperature=T)
    joint = np.zeros((vocab, vocab))
    joint[firsts] = q1[firsts, None] * q2
    joint = joint.ravel()
    assert abs(joint.sum() - 1) < 1e-6
    for member in range(G):
        assert chi_square_p(pairs[:, member, 0] * vocab + pairs[:, member, 1], joint) > ALPHA, member
