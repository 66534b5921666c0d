"""Does the same seed give the same texts in another batch? Per design, alone vs inside busy batches.

Each group (explicit members: the same design, seed and member indices in both runs)
is generated twice on one engine:

* **alone** — one group per ``generate`` call (its G members, nothing else in the batch);
* **busy** — every group at once, shuffled among filler requests of other prompts and
  lengths, so each member's rows are computed in other, changing batches.

Per design it prints the share of members whose texts are identical, the share whose
first tokens agree, and the median first divergent step of the others. Designs:
``iid`` (a fresh counter-based uniform per step: a logit difference changes a token
only when u lies that close to an interval edge — what vLLM's seeded sampling gives),
``sobol`` (per-step uniforms, no carry) and the carry designs ``lattice`` and
``stratified`` (the residual carry divides by q(token) every step, so a difference
grows). On CPUs whose logits do not depend on the batch every row is identical.

    python benchmarks/reproducibility.py [--problems 8] [--n 8] [--max-tokens 48] [--model DIR] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np

DESIGNS = ("iid", "sobol", "lattice", "stratified")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--problems", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="members per group")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quick", action="store_true", help="2 problems, n = 4, 8 tokens: checks that it runs")
    args = p.parse_args()
    if args.quick:
        args.problems, args.n, args.max_tokens = 2, 4, 8
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from qmc_sampler.eval.runs.runner import build_engine, shutdown_engine
    from qmc_sampler.eval.tasks.catalog import get_task
    from vllm import SamplingParams

    from qmc_sampler.cpu_defaults import describe_cpu
    from qmc_sampler.models import resolve_model

    task = get_task(args.task)
    problems = task.problems(args.problems, 0)
    llm, where = build_engine(resolve_model(args.model), args.dtype)
    print(f"{describe_cpu()}; {where}", flush=True)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(pr.messages, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for pr in problems
    ]

    def member(design: str, problem: int, index: int) -> tuple[dict, SamplingParams]:
        extra = {"qmc_method": design, "qmc_seed": 1000 + problem, "qmc_group": f"repro-{design}-{problem}",
                 "qmc_index": index, "qmc_n": args.n}  # fmt: skip
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                min_tokens=args.max_tokens, extra_args=extra)  # fmt: skip
        return {"prompt_token_ids": prompts[problem]}, params

    keys = [(d, pr, i) for d in DESIGNS for pr in range(len(problems)) for i in range(args.n)]
    try:
        alone = {}
        for d in DESIGNS:
            for pr in range(len(problems)):
                requests = [member(d, pr, i) for i in range(args.n)]
                outs = llm.generate([r for r, _ in requests], [s for _, s in requests], use_tqdm=False)
                alone.update({(d, pr, i): tuple(o.outputs[0].token_ids) for i, o in enumerate(outs)})
        rng = random.Random(0)
        filler = [
            ({"prompt_token_ids": prompts[rng.randrange(len(prompts))][: rng.randint(4, 40)]},
             SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 2 * args.max_tokens)))
            for _ in range(len(keys))
        ]  # fmt: skip
        batch = [(k, *member(*k)) for k in keys] + [(None, *f) for f in filler]
        rng.shuffle(batch)
        outs = llm.generate([r for _, r, _ in batch], [s for _, _, s in batch], use_tqdm=False)
        busy = {k: tuple(o.outputs[0].token_ids) for (k, _, _), o in zip(batch, outs, strict=True) if k is not None}
    finally:
        shutdown_engine(llm)

    print(f"\n{len(problems)} groups of n = {args.n} per design, {args.max_tokens} tokens, alone vs busy batches")
    header = f"{'design':>10}  {'identical':>9}  {'first token':>11}  {'median divergent step':>21}"
    print(header + "\n" + "-" * len(header))
    for d in DESIGNS:
        pairs = [(alone[k], busy[k]) for k in keys if k[0] == d]
        same = np.mean([a == b for a, b in pairs])
        first = np.mean([a[:1] == b[:1] for a, b in pairs])
        steps = [next(t for t, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) for a, b in pairs if a != b]
        median = f"{np.median(steps):.0f}" if steps else "—"
        print(f"{d:>10}  {same:9.3f}  {first:11.3f}  {median:>21}")


if __name__ == "__main__":
    main()
