"""What correlated rollouts give a GRPO step: groups with a learning signal, pass@G, distinct correct.

For each problem of one eval task, one group of G rollouts per sampler (G = 8
and 16 by default), i.i.d. and lattice side by side, scored with the task's
verifier, on one or both generation paths:

* ``vllm`` — vLLM with the plugin (the in-process backend of ``qmc-eval``);
* ``hf`` — transformers' ``generate`` (what TRL's ``GRPOTrainer`` runs with
  ``use_vllm=False``): i.i.d. is transformers' own sampling, lattice is
  :class:`qmc_sampler.hf.QMCGenerate`.

Per path, sampler and G it prints, averaged over problems:

* zero-var — the share of groups whose rewards are all equal (all correct or all
  wrong): GRPO's advantages are then zero and the prompt teaches nothing;
* pass@G — the share of problems with at least one correct rollout;
* distinct correct — how many *different* correct completions a group contains;
* distinct — how many different completions a group contains;
* p̂ — the per-rollout success rate (both samplers are exact: equal up to noise);

and the ratio lattice / i.i.d. The CPU is named in the first line.

    python benchmarks/rollout_diversity.py [--backend vllm,hf] [--task basic_arithmetic] [--problems 32]
                                           [--groups 8,16] [--model DIR] [--dtype auto] [--temperature 1.0]
                                           [--task-option KEY=VALUE ...] [--out GROUPS.jsonl] [--quick]

Problems are distinct (repeats of a prompt are drawn past, never counted twice).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import NoReturn

import numpy as np

SAMPLERS = ("iid", "lattice")
Collect = Callable[[str, int, object, list[str]], None]


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line error (``prog: error: …``, exit 2), no usage block (as qmc-eval's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main() -> None:
    p = OneLineParser(prog="rollout_diversity.py", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="vllm,hf", help="comma-separated: vllm, hf")
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--groups", default="8,16", help="comma-separated G (rollouts per prompt)")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                   help="generator setting, e.g. max_digits=2 (repeatable; as qmc-eval's)")  # fmt: skip
    p.add_argument("--out", default=None, help="also write every group (its rewards, distinct counts) to this JSONL")
    p.add_argument("--quick", action="store_true", help="4 problems, G = 4, 8 tokens: checks that it runs")
    args = p.parse_args()
    backends = [b.strip() for b in args.backend.split(",")]
    unknown = sorted(set(backends) - {"vllm", "hf"})
    if unknown:
        p.error(f"--backend {unknown[0]!r} is not a backend; use vllm, hf or both")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from qmc_sampler.eval.tasks.catalog import get_task

    from qmc_sampler.cpu_defaults import describe_cpu
    from qmc_sampler.models import resolve_model

    sizes = [4] if args.quick else [int(g) for g in args.groups.split(",")]
    from qmc_sampler.eval.cli import _task_option

    count = 4 if args.quick else args.problems
    try:
        task = get_task(args.task, **dict(_task_option(text) for text in args.task_option))
        # A generator's options are taken only when it draws (as qmc-eval's check).
        problems = _distinct(task, count, args.seed, p)
    except StopIteration:  # a reasoning-gym task's one-shot example must lie outside the problems drawn
        p.error(f"--problems {count}: {args.task} has no one-shot example outside {3 * count} problems; ask for fewer")
    except TypeError as e:  # a --task-option the task does not take
        p.error(f"--task-option: {e}")
    except (ValueError, argparse.ArgumentTypeError) as e:  # a bad task name or task file; KEY=VALUE misspelt
        p.error(str(e))
    except AssertionError as e:  # reasoning-gym checks its generators' settings with asserts
        p.error(f"--task-option: {str(e) or 'the task refuses these settings'}")
    max_tokens = 8 if args.quick else task.max_tokens
    model = resolve_model(args.model)
    print(describe_cpu(), flush=True)
    if args.out:  # the data behind the printed table: a header, then a line per group as it is scored
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(json.dumps({"type": "header", "cpu": describe_cpu(), "args": vars(args)}) + "\n")
    for backend in backends:
        stats: dict[tuple[str, int], list[tuple[float, ...]]] = {}

        def collect(sampler: str, g: int, problem: object, texts: list[str], stats=stats, backend=backend) -> None:
            texts = [_cut(t, task.stop) for t in texts]
            verdicts = [task.score(problem, t).correct for t in texts]
            correct = {t for t, ok in zip(texts, verdicts, strict=True) if ok}
            zero_var = all(verdicts) or not any(verdicts)
            row = (float(zero_var), float(any(verdicts)), len(correct), len(set(texts)), float(np.mean(verdicts)))
            stats.setdefault((sampler, g), []).append(row)
            if args.out:
                group = {"backend": backend, "sampler": sampler, "g": g, "problem_id": problem.problem_id}
                group |= {"rewards": [float(v) for v in verdicts], "distinct": row[3], "distinct_correct": row[2]}
                with open(args.out, "a") as f:
                    f.write(json.dumps(group) + "\n")

        start = time.perf_counter()
        run = _run_vllm if backend == "vllm" else _run_hf
        where = run(args, model, task, problems, sizes, max_tokens, collect)
        print(f"\n{backend} ({where}) — {args.task}: {len(problems)} problems, temperature {args.temperature}, "
              f"{max_tokens} tokens, {time.perf_counter() - start:.0f} s")  # fmt: skip
        _print_table(stats, sizes)


def _print_table(stats: dict[tuple[str, int], list[tuple[float, ...]]], sizes: list[int]) -> None:
    header = (f"{'G':>3}  {'sampler':>8}  {'zero-var':>8}  {'pass@G':>7}  {'distinct correct':>16}  "
              f"{'distinct':>8}  {'p̂':>6}")  # fmt: skip
    print(header + "\n" + "-" * len(header))
    for g in sizes:
        means = {}
        for sampler in SAMPLERS:
            means[sampler] = np.array(stats[(sampler, g)], dtype=float).mean(axis=0)
            zero_var, solved, distinct_correct, distinct, p_hat = means[sampler]
            print(f"{g:>3}  {sampler:>8}  {zero_var:8.3f}  {solved:7.3f}  {distinct_correct:16.2f}  "
                  f"{distinct:8.2f}  {p_hat:6.3f}")  # fmt: skip
        ratio = means["lattice"][:4] / np.maximum(means["iid"][:4], 1e-12)
        print(f"{g:>3}  {'ratio':>8}  {ratio[0]:8.2f}  {ratio[1]:7.2f}  {ratio[2]:16.2f}  {ratio[3]:8.2f}"
              "   (lattice / i.i.d.)")  # fmt: skip


def _distinct(task, count: int, seed: int, p: argparse.ArgumentParser) -> list:
    """``count`` problems with distinct prompts: a small task repeats prompts (basic_arithmetic
    has about 240), and a repeat would count one problem twice in every share's standard error.

    Raises (through ``p.error``, exit 2): the task gives fewer than ``count`` distinct prompts.
    """
    drawn = task.problems(3 * count, seed)  # (not far more: the one-shot example must stay outside the set)
    first: dict[str, object] = {}
    for pr in drawn:  # each prompt's first occurrence, in the order drawn: [:count] keeps the first ones
        first.setdefault(repr(pr.messages or pr.prompt), pr)
    unique = list(first.values())
    if len(unique) < count:
        p.error(f"--problems {count}: {len(unique)} distinct problems in {len(drawn)} drawn from {task.name}; "
                "ask for fewer, or more with --task-option (e.g. max_digits=2)")  # fmt: skip
    return unique[:count]


def _cut(text: str, stop: tuple[str, ...]) -> str:
    """The text up to and including the first stop string (what a stop-string request returns)."""
    ends = [text.index(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def _run_vllm(args, model, task, problems, sizes, max_tokens, collect: Collect) -> str:
    from qmc_sampler.eval.backends.generation import GroupJob, InProcessBackend
    from qmc_sampler.eval.runs.runner import build_engine, group_seed, shutdown_engine

    llm, where = build_engine(model, args.dtype)
    sampling = {"temperature": args.temperature, "max_tokens": max_tokens, "stop": list(task.stop)}
    jobs = [
        GroupJob(
            key=(sampler, pr.problem_id, g),
            messages=pr.messages,
            prompt=pr.prompt,
            n=g,
            seed=group_seed(args.seed, args.task, pr.problem_id, g),
            method=sampler,
            order="id",
            sampling=sampling,
        )
        for g in sizes
        for pr in problems
        for sampler in SAMPLERS  # side by side: the same seeds, interleaved
    ]
    by_id = {pr.problem_id: pr for pr in problems}
    try:
        InProcessBackend(llm).run(
            jobs, lambda job, members: collect(job.key[0], job.key[2], by_id[job.key[1]], [m.text for m in members])
        )
    finally:
        shutdown_engine(llm)
    return where


def _run_hf(args, model, task, problems, sizes, max_tokens, collect: Collect) -> str:
    import torch
    from qmc_sampler.hf import QMCGenerate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    texts = [
        tokenizer.apply_chat_template(pr.messages, tokenize=False, add_generation_prompt=True)
        if pr.messages is not None
        else pr.prompt
        for pr in problems
    ]
    lattice = QMCGenerate("lattice", seed=args.seed)
    torch.manual_seed(args.seed)  # transformers' own i.i.d. sampling draws from torch's generator
    batch = 8
    for g in sizes:
        for start in range(0, len(problems), batch):
            chunk = texts[start : start + batch]
            inputs = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            width = inputs["input_ids"].shape[1]
            for sampler in SAMPLERS:
                with torch.no_grad():
                    out = hf.generate(
                        **inputs, do_sample=True, num_return_sequences=g, max_new_tokens=max_tokens,
                        temperature=args.temperature, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id,
                        custom_generate=lattice if sampler == "lattice" else None,
                    )  # fmt: skip
                decoded = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
                for i, pr in enumerate(problems[start : start + batch]):
                    collect(sampler, g, pr, decoded[i * g : (i + 1) * g])
    return f"transformers on the CPU, float32, {torch.get_num_threads()} threads"


if __name__ == "__main__":
    main()
