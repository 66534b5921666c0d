"""Groups are keyed on every per-row model input, not on the decoder ids alone (issue 29, item 6).

Models built from configs here (nothing downloaded): a tiny random T5 (d_model 64,
2+2 layers, vocabulary 48), a tiny random LLaVA (1-layer CLIP tower, 2-layer Llama),
and the shared tiny Llama (``hf_model``, head size 64) fed ``inputs_embeds``. For the
first two, transformers hands a ``custom_generate`` callable decoder rows that are all
the same (the decoder start token; the same text with different images); with
``inputs_embeds`` the decoder ids are empty.

The reference distribution is transformers' own processed first-step distribution
(``output_scores``) at T = 2 (HF's default top-k = 50 applies). Checks: the group
structure (which rows, in member order), the exact lattice balance of every call —
each first token ⌊m·q⌋ or ⌈m·q⌉ times in each prompt's m rows — and a chi-square test
per member position (each member's first token is an exact draw from q). Fixed seeds;
family-wise α = 1e-3, Bonferroni over every chi-square test in this file (:data:`TESTS`).
"""

import dataclasses
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from qmc_sampler.hf import QMCGenerate  # noqa: E402

T = 2.0
CALLS = 200
TESTS = (2 * 3 + 2 * 4) + 2 * 3 + (2 * 3 + 2 * 4) + 2 * 3  # T5 G=3,4; inputs_embeds; merged copies G=3,4; LLaVA
ALPHA = 1e-3 / TESTS
T5_PROMPTS = [[5, 6, 7, 8, 1], [9, 10, 11, 12, 1]]


@pytest.fixture(scope="module")
def t5():
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=48, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.8)  # a few likely first tokens, different per prompt
    return model


@pytest.fixture(scope="module")
def llava():
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14, projection_dim=32,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=63, vision_feature_layer=-1
    )
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.8)
    return model


def t5_inputs(prompts):
    ids = torch.tensor(prompts)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def llava_inputs(images):
    """One row per image: the same text (4 image placeholders), a different 28×28 image each."""
    ids = torch.tensor([[2, 63, 63, 63, 63, 10, 11]] * len(images))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.stack(images)}


def hf_probs(model, inputs) -> np.ndarray:
    """transformers' processed first-step distribution per prompt: ``[prompts, vocab] float64``."""
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=True, max_new_tokens=1, temperature=T, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    return torch.softmax(out.scores[0].double(), -1).numpy()


def first_tokens(model, inputs, generator, g, calls=CALLS) -> np.ndarray:
    """The first generated token of every row over ``calls`` calls: ``[calls, prompts · g]``."""
    out = []
    for _ in range(calls):
        with torch.no_grad():
            seq = model.generate(**inputs, do_sample=True, num_return_sequences=g, max_new_tokens=1, temperature=T,
                                 pad_token_id=0, custom_generate=generator)  # fmt: skip
        out.append(seq[:, -1].numpy())
    return np.stack(out)


@pytest.fixture(scope="module")
def assert_one_group_per_prompt(balanced, chi_square_p):
    def check(generator, first, q, g):
        """Prompt p's g copies (rows pg…pg+g−1) are one group, balanced in every call, each member exact."""
        prompts = len(q)
        assert [g_.rows for g_ in generator.last_groups] == [tuple(range(p * g, (p + 1) * g)) for p in range(prompts)]
        for p in range(prompts):
            rows = first[:, p * g : (p + 1) * g]
            assert all(balanced(call, q[p]) for call in rows), p
            for member in range(g):
                assert chi_square_p(rows[:, member], q[p]) > ALPHA, (p, member)

    return check


def has_power(q):
    """The prompts' distributions differ and have several likely tokens (else the checks cannot fail)."""
    assert 0.5 * np.abs(q[0] - q[1]).sum() > 0.1
    assert all(row.max() < 0.8 and (row > 0.05).sum() >= 2 for row in q)


@pytest.mark.parametrize("g", [3, 4])
def test_encoder_decoder_prompts_are_separate_groups(t5, g, assert_one_group_per_prompt):
    # Every decoder row starts as the decoder start token: only the encoder inputs tell the prompts apart.
    inputs = t5_inputs(T5_PROMPTS)
    q = hf_probs(t5, inputs)
    has_power(q)
    generator = QMCGenerate("lattice", seed=11)
    assert_one_group_per_prompt(generator, first_tokens(t5, inputs, generator, g), q, g)


def test_encoder_decoder_repeated_prompts_merge_like_trls_batches(t5, balanced):
    # TRL repeats each prompt G times in a row with num_return_sequences=1.
    inputs = t5_inputs([T5_PROMPTS[0]] * 4 + [T5_PROMPTS[1]] * 4)
    q = hf_probs(t5, t5_inputs(T5_PROMPTS))
    generator = QMCGenerate("lattice", seed=12)
    first = first_tokens(t5, inputs, generator, 1, calls=50)
    assert [g.rows for g in generator.last_groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all(balanced(call[:4], q[0]) and balanced(call[4:], q[1]) for call in first)


def test_inputs_embeds_prompts_are_separate_groups(hf_model, assert_one_group_per_prompt):
    # Decoder-only with inputs_embeds: the decoder ids are empty, the embeddings are the prompt.
    ids = torch.tensor([[381, 311, 31, 346], [335, 93, 368, 353]])  # "answer: 42", "sphinx of black" (tiny BPE)
    with torch.no_grad():
        inputs = {"inputs_embeds": hf_model.get_input_embeddings()(ids), "attention_mask": torch.ones_like(ids)}
    q = hf_probs(hf_model, inputs)
    has_power(q)
    generator = QMCGenerate("lattice", seed=13)
    assert_one_group_per_prompt(generator, first_tokens(hf_model, inputs, generator, 3), q, 3)


def test_vision_language_prompts_that_differ_only_in_their_images_are_separate_groups(
    llava, assert_one_group_per_prompt
):
    torch.manual_seed(1)
    inputs = llava_inputs([torch.randn(3, 28, 28), torch.randn(3, 28, 28)])
    q = hf_probs(llava, inputs)
    has_power(q)
    generator = QMCGenerate("lattice", seed=14)
    assert_one_group_per_prompt(generator, first_tokens(llava, inputs, generator, 3), q, 3)


def test_vision_language_rows_with_the_same_image_merge(llava):
    torch.manual_seed(2)
    a, b = torch.randn(3, 28, 28), torch.randn(3, 28, 28)
    generator = QMCGenerate("lattice", seed=15)
    first_tokens(llava, llava_inputs([a, a, b, b]), generator, 1, calls=1)
    assert [g.rows for g in generator.last_groups] == [(0, 1), (2, 3)]


@pytest.mark.parametrize(
    ("g", "member_rows"),
    [(3, (0, 3, 1, 4, 2, 5)), (4, (0, 1, 2, 3, 4, 5, 6, 7))],
    ids=["n=6-round-robin", "n=8-radical-inverse-blocks"],
)
def test_a_prompt_given_twice_is_one_group_whose_copies_are_each_balanced(t5, g, member_rows, balanced, chi_square_p):
    # Lattice of n = 2g: for n = 6 (codes i/6 + Δ in member order) the copies' members alternate, so each
    # copy holds a shifted lattice of size g; for n = 8 (radical-inverse order) each aligned block of 4
    # members already is one. Either way each copy is balanced on its own, and the merged group too.
    inputs = t5_inputs([T5_PROMPTS[0]] * 2)
    q = hf_probs(t5, t5_inputs(T5_PROMPTS[:1]))[0]
    generator = QMCGenerate("lattice", seed=16)
    first = first_tokens(t5, inputs, generator, g)
    assert [group.rows for group in generator.last_groups] == [member_rows]
    for call in first:
        assert balanced(call, q)
        assert balanced(call[:g], q) and balanced(call[g:], q), call
    for member, row in enumerate(member_rows):
        assert chi_square_p(first[:, row], q) > ALPHA, member


@dataclasses.dataclass(frozen=True)
class Style:
    """An opaque per-call model argument: nothing tells which rows it belongs to."""

    name: str


class StyledLlama(transformers.LlamaForCausalLM):
    """The tiny Llama with one extra forward argument of a type qmc-sampler does not know."""

    def forward(self, *args, style=None, **kwargs):
        return super().forward(*args, **kwargs)


def test_an_input_that_cannot_be_split_by_row_warns_once_and_groups_each_prompts_copies_only(tiny_model_dir):
    model = StyledLlama.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[381, 311, 31, 346]] * 2)  # one prompt given twice: its two blocks would merge
    generator = QMCGenerate("lattice", seed=17)

    def call():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                           num_return_sequences=2, max_new_tokens=1, pad_token_id=0, custom_generate=generator,
                           style=Style("terse"))  # fmt: skip

    message = r"style: .*Style is not a tensor.*grouped by num_return_sequences copies only"
    with pytest.warns(UserWarning, match=message):
        call()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    assert not [w for w in caught if "qmc-sampler" in str(w.message)]  # once per generator and set of inputs
    assert [g.rows for g in generator.last_groups] == [(0, 1), (2, 3)]
    assert generator.stats.copies_only_calls == 2 and generator.stats.calls == 2
