"""Correlated groups in transformers' own ``generate`` (tiny random Llama, T = 1.5), no vLLM.

The reference distribution is transformers' own: the processed scores its ``generate``
returns (``output_scores``) for the same inputs and settings, i.e. exactly what its
``multinomial`` samples from — after HF's default ``top_k=50``, or top-p with min-p.
Statistical tests: family-wise α = 1e-3, Bonferroni over every per-member chi-square
test in this file (:data:`TESTS`).
"""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from qmc_sampler.hf import QMCGenerate, patch_generate  # noqa: E402

T = 1.5
G = 8
GROUPS = 300
SETTINGS = {
    "hf-default-top-k-50": {"temperature": T},
    "top-p-and-min-p": {"temperature": T, "top_k": 0, "top_p": 0.9, "min_p": 0.05},
}
TESTS = 2 * G + 2 * G + 2 * G  # two settings, the left-padded batch (two prompts), the two-token tests
ALPHA = 1e-3 / TESTS


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    return tok


def inputs_for(tokenizer, prompts):
    return tokenizer(prompts, return_tensors="pt", padding=True)


def hf_probs(model, inputs, **settings) -> np.ndarray:
    """transformers' processed next-token distribution per row: ``[rows, vocab] float64``."""
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=True, max_new_tokens=1, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, **settings)  # fmt: skip
    return torch.softmax(out.scores[0].double(), -1).numpy()


def generate_groups(model, inputs, generator, groups, new_tokens=1, g=G, **settings):
    """``groups`` calls of ``generate`` with ``num_return_sequences=g``: ``[groups, rows, new_tokens]``
    (rows that end early are padded with 0)."""
    width = inputs["input_ids"].shape[1]
    out = []
    for _ in range(groups):
        with torch.no_grad():
            seq = model.generate(**inputs, do_sample=True, num_return_sequences=g, max_new_tokens=new_tokens,
                                 pad_token_id=0, custom_generate=generator, **settings)  # fmt: skip
        rows = seq[:, width:].numpy()
        out.append(np.pad(rows, ((0, 0), (0, new_tokens - rows.shape[1]))))  # all rows ended at once
    return np.stack(out)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_member_is_an_exact_draw_and_every_lattice_group_is_balanced(
    hf_model, tokenizer, setting, balanced, chi_square_p
):
    inputs = inputs_for(tokenizer, ["the quick brown"])
    q = hf_probs(hf_model, inputs, **SETTINGS[setting])[0]
    assert q.max() < 0.7 and (q > 0).sum() > 5  # a flat enough distribution for the tests to have power
    first = generate_groups(hf_model, inputs, QMCGenerate("lattice", seed=1), GROUPS, **SETTINGS[setting])[:, :, 0]
    assert all(balanced(group, q) for group in first)
    for member in range(G):
        assert chi_square_p(first[:, member], q) > ALPHA, (setting, member)


def test_a_left_padded_batch_of_different_prompts_is_one_group_per_prompt(hf_model, tokenizer, balanced, chi_square_p):
    inputs = inputs_for(tokenizer, ["the quick brown", "pack my box with five dozen"])
    assert (inputs["attention_mask"] == 0).any()  # really left-padded
    q = hf_probs(hf_model, inputs, temperature=T)
    generator = QMCGenerate("lattice", seed=2)
    first = generate_groups(hf_model, inputs, generator, GROUPS // 2, temperature=T)[:, :, 0]
    assert [len(g.rows) for g in generator.last_groups] == [G, G]
    for p in range(2):
        rows = first[:, p * G : (p + 1) * G]  # repeat_interleave: prompt p's copies are rows pG..pG+G-1
        assert all(balanced(group, q[p]) for group in rows), p
        for member in range(G):
            assert chi_square_p(rows[:, member], q[p]) > ALPHA, (p, member)


@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos-mid-group"])
def test_the_carry_keeps_the_second_token_exact(hf_model, tokenizer, eos, chi_square_p):
    # With eos: the likeliest first token ends a member, whose second position is then padding,
    # while the other members of the same group draw their second token on.
    inputs = inputs_for(tokenizer, ["the quick brown"])
    q1 = hf_probs(hf_model, inputs, temperature=T)[0]
    eos_ids = {int(hf_model.generation_config.eos_token_id)} | ({int(np.argmax(q1))} if eos else set())
    pairs = generate_groups(hf_model, inputs, QMCGenerate("lattice", seed=3), GROUPS, new_tokens=2, temperature=T,
                            eos_token_id=sorted(eos_ids))  # fmt: skip
    firsts = sorted(set(pairs[:, :, 0].ravel().tolist()))
    vocab = len(q1)
    joint = np.zeros(vocab * vocab)
    for a in firsts:  # q(a, b) = q1(a) · q2(b | a), q2 from transformers on the prompt + a
        if a in eos_ids:
            joint[a * vocab + 0] = q1[a]  # a finished row is padded (pad_token_id=0)
            continue
        extended = {k: torch.cat([v, torch.tensor([[a if k == "input_ids" else 1]])], 1) for k, v in inputs.items()}
        joint[a * vocab : (a + 1) * vocab] = q1[a] * hf_probs(hf_model, extended, temperature=T)[0]
    assert joint.sum() > 0.99  # first tokens never drawn by any member carry almost no mass
    for member in range(G):
        codes = pairs[:, member, 0] * vocab + pairs[:, member, 1]
        assert chi_square_p(codes, joint) > ALPHA, member


def test_members_that_hit_eos_are_padded_while_the_others_go_on(hf_model, tokenizer, balanced):
    inputs = inputs_for(tokenizer, ["the quick brown"])
    q = hf_probs(hf_model, inputs, temperature=T)[0]
    eos = int(np.argmax(q))  # the likeliest first token ends a member after one token
    generator = QMCGenerate("lattice", seed=4)
    with torch.no_grad():
        out = hf_model.generate(**inputs, do_sample=True, num_return_sequences=G, max_new_tokens=5, temperature=T,
                                eos_token_id=eos, pad_token_id=0, custom_generate=generator)  # fmt: skip
    new = out[:, inputs["input_ids"].shape[1] :]
    ended = new[:, 0] == eos
    assert 0 < int(ended.sum()) < G  # some members ended at once, some did not
    assert (new[ended, 1:] == 0).all()  # transformers pads finished rows
    assert (new[~ended, 1] != 0).any()  # and the others went on
    assert balanced(new[:, 0].numpy(), q)
    assert generator.stats.unsampleable == 0


def test_repeated_prompt_rows_are_grouped_like_trls_batches(hf_model, tokenizer, balanced):
    # TRL's GRPO repeats each prompt G times in a row and calls generate with num_return_sequences=1.
    prompts = ["the quick brown"] * 4 + ["pack my box with five dozen"] * 4
    inputs = inputs_for(tokenizer, prompts)
    q = hf_probs(hf_model, inputs_for(tokenizer, prompts[3:5]), temperature=T)
    generator = QMCGenerate("lattice", seed=5)
    with torch.no_grad():
        hf_model.generate(**inputs, do_sample=True, max_new_tokens=1, temperature=T, pad_token_id=0,
                          custom_generate=generator)  # fmt: skip
    assert [g.rows for g in generator.last_groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for group, probs in zip(generator.last_groups, q, strict=True):
        assert balanced(np.array(group.first_tokens), probs)


def test_the_same_seed_gives_the_same_groups_and_other_seeds_other_groups(hf_model, tokenizer):
    inputs = inputs_for(tokenizer, ["the quick brown"])
    a, b, c = (generate_groups(hf_model, inputs, QMCGenerate("sobol", seed=s), 2, new_tokens=4, temperature=T)
               for s in (9, 9, 10))  # fmt: skip
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert not np.array_equal(a[0], a[1])  # each call is a new group


@pytest.mark.parametrize(
    ("settings", "mode"),
    [({"do_sample": False}, "greedy_search"), ({"do_sample": True, "num_beams": 2}, "beam_sample")],
)
def test_modes_that_do_not_sample_are_refused(hf_model, tokenizer, settings, mode):
    with pytest.raises(ValueError, match=f"this generate call is {mode}"):
        hf_model.generate(**inputs_for(tokenizer, ["the quick brown"]), max_new_tokens=2, pad_token_id=0,
                          custom_generate=QMCGenerate("lattice"), **settings)  # fmt: skip


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="method='lattic' is not a design"):
        QMCGenerate("lattic")
    with pytest.raises(ValueError, match="order='random' is not a vocabulary order"):
        QMCGenerate("lattice", order="random")
    with pytest.raises(ValueError, match="seed='1' is not a seed; use an int between -9223372036854775808 and"):
        QMCGenerate("lattice", seed="1")
    with pytest.raises(ValueError, match=r"seed=1180591620717411303424 is not a seed; use an int between .* or None"):
        QMCGenerate("lattice", seed=2**70)


def test_patch_generate_correlates_sampling_calls_and_passes_the_others_through(hf_model, tokenizer):
    inputs = inputs_for(tokenizer, ["the quick brown"])
    handle = patch_generate(hf_model, "lattice", seed=6)
    try:
        with pytest.raises(ValueError, match="already patched"):
            patch_generate(hf_model)
        with torch.no_grad():
            hf_model.generate(**inputs, do_sample=True, num_return_sequences=G, max_new_tokens=1, temperature=T,
                              pad_token_id=0)  # fmt: skip
            greedy = hf_model.generate(**inputs, do_sample=False, max_new_tokens=3, pad_token_id=0)
        assert handle.generator.stats.calls == 1 and [len(g.rows) for g in handle.generator.last_groups] == [G]
    finally:
        handle.restore()
    with torch.no_grad():
        assert torch.equal(hf_model.generate(**inputs, do_sample=False, max_new_tokens=3, pad_token_id=0), greedy)
    assert "generate" not in hf_model.__dict__
