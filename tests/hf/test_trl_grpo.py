"""A real TRL ``GRPOTrainer`` step on the CPU with ``use_vllm=False`` (its default) and
:func:`qmc_sampler.hf.patch_generate`: each prompt's G rollouts are one balanced group.

TRL repeats each prompt G times in a row and calls the model's ``generate``; the
patch makes those G rows one lattice group. Checked from the trainer's own logged
completions (G per prompt) and the groups the patched generator formed (first tokens
balanced against transformers' processed distribution under TRL's generation config).
"""

import math

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL not installed")
datasets = pytest.importorskip("datasets")
from qmc_sampler.hf import patch_generate  # noqa: E402

G = 8
PROMPTS = ["the quick brown", "pack my box with five dozen"]


def reward_length(completions, **_):
    return [float(len(c)) for c in completions]


def test_a_grpo_step_makes_each_prompts_rollouts_one_balanced_group(tiny_model_dir, tmp_path, balanced):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=6,
        max_steps=1, logging_steps=1, report_to=[], use_cpu=True, bf16=False, temperature=1.5,
        log_completions=True, save_strategy="no", seed=0,
    )  # fmt: skip
    dataset = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward_length, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    # transformers' processed first-token distribution under TRL's own generation config (before the update).
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        scores = model.generate(**batch, generation_config=trainer.generation_config, max_new_tokens=1,
                                output_scores=True, return_dict_in_generate=True).scores[0]  # fmt: skip
    q = {p: torch.softmax(scores[i].double(), -1).numpy() for i, p in enumerate(PROMPTS)}

    handle = patch_generate(trainer.model, "lattice", seed=0)
    try:
        trainer.train()
    finally:
        handle.restore()

    groups = handle.generator.last_groups
    assert handle.generator.stats.calls == 1 and sorted(len(g.rows) for g in groups) == [G, G]
    logged = list(zip(trainer._logs["prompt"], trainer._logs["completion"], strict=True))
    assert sorted({p for p, _ in logged}) == sorted(PROMPTS)
    assert all(sum(p == prompt for p, _ in logged) == G for prompt in PROMPTS)  # G rollouts per prompt
    logged_prompts = [p for p, _ in logged]  # in the generation batch's row order (one process)
    for group in groups:
        prompt = logged_prompts[group.rows[0]]
        assert balanced(np.array(group.first_tokens), q[prompt]), (prompt, group.first_tokens)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(v) for v in losses)
    assert trainer.state.global_step == 1
