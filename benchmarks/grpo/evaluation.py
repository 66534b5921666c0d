"""The held-out reward: greedy completions of the held-out problems, scored by the task's verifier."""

from __future__ import annotations

from typing import Any

import numpy as np

from grpo.data import cut


def heldout_reward(model: Any, tokenizer: Any, task: Any, problems: list[Any], max_tokens: int) -> float:
    """Mean verifier reward of greedy completions of ``problems`` (batches of 32, left-padded)."""
    import torch

    texts = [
        tokenizer.apply_chat_template(pr.messages, tokenize=False, add_generation_prompt=True)
        if pr.messages is not None
        else pr.prompt
        for pr in problems
    ]
    was_training = model.training
    model.eval()
    scores = []
    try:
        for start in range(0, len(texts), 32):
            batch = tokenizer(texts[start : start + 32], return_tensors="pt", padding=True, add_special_tokens=False)
            batch = batch.to(model.device)
            with torch.no_grad():
                out = model.generate(
                    **batch, do_sample=False, max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id
                )
            decoded = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            for pr, text in zip(problems[start : start + 32], decoded, strict=True):
                scores.append(float(task.score(pr, cut(text, task.stop)).correct))
    finally:
        model.train(was_training)
    return float(np.mean(scores))
