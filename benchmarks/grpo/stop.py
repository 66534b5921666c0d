"""Training rollouts cut at the task's stop string, as evaluation's are (and as vLLM's ``stop`` would cut them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def stop_position(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str], stop: tuple[str, ...]) -> int:
    """How many of a completion's tokens to keep: up to and including the first token whose text
    completes a stop string (all of them where no stop string occurs).

    Args:
        token_ids: one completion's generated token ids (no prompt).
        decode: ids → text (the tokenizer's ``decode``, special tokens skipped).
        stop: the task's stop strings.

    Returns:
        ``k`` with ``token_ids[:k]`` the kept tokens, 1 ≤ k ≤ len(token_ids) (0 for an empty completion).
    """
    if not stop or not any(s in decode(token_ids) for s in stop):
        return len(token_ids)
    for k in range(1, len(token_ids) + 1):  # ≤ max_completion_length decodes, only for rows that stop
        if any(s in decode(token_ids[:k]) for s in stop):
            return k
    return len(token_ids)


def cut_generate_at_stop(model: Any, tokenizer: Any, stop: tuple[str, ...]) -> Callable[[], None]:
    """Wrap ``model.generate`` (already patched by ``patch_generate``) so that each row's tokens after
    its stop string become the end-of-sequence token: TRL's transformers path masks a completion after
    its first EOS (``GRPOTrainer._generate_single_turn``), so the rollout it scores and trains on ends at
    the stop string, followed by that one EOS (the token a chat model ends its turn with). That EOS,
    never sampled, is scored and trained on (TRL's mask keeps a completion's first EOS): a ``stop``-cut
    vLLM rollout has no such token. Both designs get the same. The design's draws are untouched: only
    tokens after the cut are replaced.

    Args:
        model: the policy whose ``generate`` TRL calls (returns ``[batch, prompt + completion]`` ids).
        tokenizer: its tokenizer (``decode``, ``eos_token_id``).
        stop: the task's stop strings.

    Returns:
        ``restore()``: gives the model back the ``generate`` it had (call before ``patch_generate``'s restore).

    Raises:
        ValueError: the tokenizer has no EOS token (nothing for TRL's mask to stop at).
        TypeError (from the patched ``generate``): the model's ``generate`` returned no tensor of ids.
    """
    import torch

    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: TRL's completion mask could not end at a stop string")
    inner = model.generate

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        prompt = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
        if not isinstance(out, torch.Tensor):  # e.g. return_dict_in_generate: the cut would be skipped unseen
            raise TypeError(f"model.generate returned {type(out).__name__}, not a tensor of ids: cannot cut at stop")
        if out.shape[1] <= prompt:
            return out
        out = out.clone()
        for row in range(out.shape[0]):
            completion = out[row, prompt:].tolist()
            ends = [i for i, t in enumerate(completion) if t == eos]
            upto = ends[0] if ends else len(completion)  # TRL masks after the first EOS anyway
            keep = stop_position(completion[:upto], decode, stop)
            out[row, prompt + keep :] = eos
        return out

    model.generate = generate

    def restore() -> None:
        model.generate = inner

    return restore
