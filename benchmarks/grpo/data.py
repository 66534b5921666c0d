"""The task's problems, split once into training and held-out, and a step's batch: its texts and its groups."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from grpo.plan import OneLineParser

POOL = 600  # problems drawn before de-duplication (basic_arithmetic has ~240 distinct; 600 give ~220)


def split_problems(task: Any, args: argparse.Namespace, p: OneLineParser) -> tuple[list[Any], list[Any]]:
    """The task's distinct problems, split into (training, held-out) by a Generator seeded
    with ``--data-seed``.

    Args:
        task: the eval task (``--task``). args: ``--heldout``, ``--prompts`` (at least that many
        training problems must remain) and ``--data-seed``. p: for the one-line errors (exit 2):
        too few problems, or the task failing to give them.

    Returns:
        Two disjoint lists of ``Problem``; held-out has ``--heldout`` problems.
    """
    heldout, data_seed = args.heldout, args.data_seed
    try:
        drawn = task.problems(POOL, data_seed)
    except AssertionError as e:  # reasoning-gym checks its generators' settings with asserts, when it draws
        p.error(f"--task-option: {str(e) or 'the task refuses these settings'}")
    except TypeError as e:  # a --task-option the task's generator does not take (found when it draws)
        p.error(f"--task-option: {e}")
    except Exception as e:  # e.g. StopIteration: the task's one-shot example pool ran dry for this seed
        p.error(
            f"--task {args.task} --data-seed {data_seed}: the task could not give its problems "
            f"({type(e).__name__}: {str(e) or 'no message'}); try another --data-seed"
        )
    distinct: dict[str, Any] = {}
    for problem in drawn:
        distinct.setdefault(json.dumps(problem.messages or problem.prompt), problem)
    problems = list(distinct.values())
    if len(problems) - heldout < args.prompts:
        p.error(
            f"--heldout {heldout}: the task gives {len(problems)} distinct problems, which leaves "
            f"{max(len(problems) - heldout, 0)} for training, fewer than --prompts {args.prompts}; use fewer "
            "(--prompts or --heldout) or a task with more problems (basic_arithmetic: --task-option max_terms=3)"
        )
    order = np.random.default_rng(data_seed).permutation(len(problems))
    return [problems[i] for i in order[heldout:]], [problems[i] for i in order[:heldout]]


def cut(text: str, stop: tuple[str, ...]) -> str:
    """The text up to and including its first stop string (what a stop-string request returns)."""
    ends = [text.index(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def completion_text(completion: Any) -> str:
    """A TRL completion's text (conversational: a list with one assistant message)."""
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def grouped(problem_ids: list[Any], prompts: int, g: int) -> bool:
    """Whether a step's batch is ``prompts × g`` rows: ``prompts`` distinct problem ids, each on
    ``g`` consecutive rows (TRL's RepeatSampler's layout, the one the figures assume)."""
    heads = problem_ids[::g]
    return (
        len(problem_ids) == prompts * g
        and len(set(heads)) == prompts
        and all(problem_ids[i * g : (i + 1) * g] == [head] * g for i, head in enumerate(heads))
    )


def group_stats(
    problem_ids: list[Any], rewards: list[float], completion_ids: list[list[int]], answers: list[str | None]
) -> dict[str, float]:
    """Per group (one prompt's rows), averaged over the groups: the share whose rewards are all equal
    (no GRPO signal), distinct token sequences, and distinct answers as the verifier parses them
    (``extract_answer`` of the completion cut at the stop string; no answer counts as one value)."""
    groups: dict[Any, list[int]] = {}
    for row, pid in enumerate(problem_ids):
        groups.setdefault(pid, []).append(row)
    zero_var = [len({rewards[r] for r in rows}) == 1 for rows in groups.values()]
    distinct = [len({tuple(completion_ids[r]) for r in rows}) for rows in groups.values()]
    distinct_answers = [len({answers[r] for r in rows}) for rows in groups.values()]
    return {
        "zero_var_share": float(np.mean(zero_var)),
        "distinct_per_group": float(np.mean(distinct)),
        "distinct_answers_per_group": float(np.mean(distinct_answers)),
    }
