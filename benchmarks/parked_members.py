"""The registry's host time per step with 0 vs 50,000 parked members: does parking scale?

A hot identical prompt (the server's default design, lm-eval repeats) parks a member
for every request that leaves the batch, finished or preempted — vLLM does not say
which — so tens of thousands can be parked under one group key. This times, in one
process and alternating between them, the same workload on three registries:

* ``empty``  — nothing parked beforehand;
* ``hot``    — ``--parked`` members parked beforehand under the batch's own group key
  (its per-key bound raised above that, so they all stay: the index at its largest);
* ``spread`` — ``--parked`` members parked beforehand over ``--parked / 50`` group keys
  (50 of them under the batch's key), with the default bounds.

Each step is what the processor asks of the registry: sync every row of a batch of
``--rows`` live members with the engine's count (the last draw accepted), then churn —
two rows preempted (parked, and back two steps later with their output, found by
history among the parked), two finished (parked, never back) and replaced by new
requests, two left out of the step and reclaimed (Model Runner V2 parks those) — and
draw every row's token (the fused kernel on ``[rows, --vocab]`` logits; a small
vocabulary, so the registry's own work is not hidden behind the kernel). It prints
the median step time of each registry, the mean admission time, and the ratios to
``empty`` (target ≤ 1.1), naming the CPU.

Members parked beforehand are admitted under keys of their own and filed under the
target key at parking, so that filling 50,000 costs the same on any registry.

    python benchmarks/parked_members.py [--parked 50000] [--rows 64] [--steps 100] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Workload:
    """One registry and the engine-side state of its batch (output lists, waiting requests)."""

    name: str
    registry: object
    rng: random.Random
    live: list = field(default_factory=list)  # [member, output ids]
    waiting: list = field(default_factory=list)  # preempted: (steps left, output ids)
    step_s: list[float] = field(default_factory=list)
    admit_s: list[float] = field(default_factory=list)


def make_registry(per_key: int | None):
    from qmc_sampler.members import MemberRegistry

    if per_key is not None and "max_parked_per_key" in MemberRegistry.__dataclass_fields__:
        return MemberRegistry(max_parked_per_key=per_key)
    return MemberRegistry()  # (a registry from before the per-key bound: --parked is kept anyway)


def fill(registry, count: int, keys: list[str], rng: random.Random) -> None:
    """Park ``count`` members round-robin over ``keys``, each with a random history of 1 to 32 tokens."""
    from qmc_sampler.members import PER_REQUEST, GroupArgs, RowSampling

    plain = RowSampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    for i in range(count):
        output = [rng.randrange(256) for _ in range(rng.randint(1, 32))]
        member = registry.admit(GroupArgs(PER_REQUEST, "lattice", "id", 1, 1 << 30, f"fill:{i}"), plain, [1], output)
        member.group_key = keys[i % len(keys)]  # filed under the target key when parked
        registry.park(member)


class Step:
    """The per-step workload (see the module docstring), the same for every registry."""

    def __init__(self, rows: int, vocab: int) -> None:
        import torch

        from qmc_sampler.members import PER_REQUEST, GroupArgs, RowSampling

        self.torch = torch
        self.rows = rows
        self.request = GroupArgs(PER_REQUEST, "lattice", "id", 7, 1 << 30, "hot")
        self.sampling = RowSampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        self.logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
        self.temperature = torch.ones(rows)

    def admit(self, w: Workload, output: list[int]) -> None:
        start = time.perf_counter()
        member = w.registry.admit(self.request, self.sampling, [1, 2, 3], output, id(output))
        w.admit_s.append(time.perf_counter() - start)
        w.live.append([member, output])

    def run(self, w: Workload, last_tokens: list[int] | None) -> list[int]:
        reg, rng = w.registry, w.rng
        if last_tokens is not None:  # the engine accepted every drawn token
            for (member, output), token in zip(w.live, last_tokens, strict=True):
                output.append(token)
                reg.sync(member, len(output), token)
        for _ in range(2):  # preempted: parked, back in two steps with its output
            member, output = w.live.pop(rng.randrange(len(w.live)))
            reg.park(member, len(output), output[-1] if output else None)
            w.waiting.append([2, output])
        for _ in range(2):  # finished: parked (vLLM does not say which), never back
            member, output = w.live.pop(rng.randrange(len(w.live)))
            reg.park(member, len(output), output[-1] if output else None)
        for entry in w.waiting:
            entry[0] -= 1
        back = [output for left, output in w.waiting if left <= 0]
        w.waiting = [entry for entry in w.waiting if entry[0] > 0]
        for output in back:
            self.admit(w, output)
        while len(w.live) < self.rows:
            self.admit(w, [])
        for _ in range(2):  # left out of this step and back at once (Model Runner V2)
            member = w.live[rng.randrange(len(w.live))][0]
            reg.park(member)
            assert reg.reclaim(member)
        members = [m for m, _ in w.live]
        slots = self.torch.tensor([m.slot for m in members], dtype=self.torch.int64)
        draw = reg.draw(self.logits, members, self.temperature, None, None, None, slots=slots)
        return draw.tokens.tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parked", type=int, default=50_000, help="members parked beforehand (hot, spread)")
    p.add_argument("--rows", type=int, default=64, help="live rows in the batch")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=100, help="steps per round and registry")
    p.add_argument("--rounds", type=int, default=5, help="rounds, alternating the registries")
    p.add_argument("--quick", action="store_true", help="2,000 parked, 16 rows, 2 × 20 steps: checks that it runs")
    args = p.parse_args()
    if args.quick:
        args.parked, args.rows, args.steps, args.rounds = 2_000, 16, 20, 2

    import torch

    from qmc_sampler.cpu_defaults import describe_cpu

    torch.set_num_threads(1)  # the registry's work is the host's; one thread, as vLLM's CPU worker has
    logging.getLogger("vllm.qmc_sampler").setLevel(logging.ERROR)  # every filled member is a "lost" one
    print(describe_cpu(), flush=True)
    fill_rng = random.Random(1)
    spread_keys = ["hot"] + [f"cold:{k}" for k in range(max(args.parked // 50, 1) - 1)]
    workloads = []
    setups = (("empty", None, None), ("hot", 2 * args.parked, ["hot"]), ("spread", None, spread_keys))
    for name, per_key, keys in setups:
        reg = make_registry(per_key)
        start = time.perf_counter()
        if keys is not None:
            fill(reg, args.parked, keys, fill_rng)
        print(f"{name:>6}: {reg.parked():>6} parked over {len(keys or [])} key(s), filled in "
              f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
        workloads.append(Workload(name, reg, random.Random(2)))
    step = Step(args.rows, args.vocab)
    last: dict[str, list[int] | None] = {w.name: None for w in workloads}
    for w in workloads:  # the batch's first members, and a warm-up step (not timed)
        while len(w.live) < args.rows:
            step.admit(w, [])
        last[w.name] = step.run(w, None)
        w.admit_s.clear()
    for _ in range(args.rounds):
        for w in workloads:  # side by side: each round runs every registry in turn
            for _ in range(args.steps):
                start = time.perf_counter()
                last[w.name] = step.run(w, last[w.name])
                w.step_s.append(time.perf_counter() - start)
    base = statistics.median(workloads[0].step_s)
    print(f"\n{args.rows} live rows, vocabulary {args.vocab}, {args.rounds} × {args.steps} steps per registry")
    print(f"{'registry':>8} {'parked':>7} {'step ms (median)':>17} {'admission µs (mean)':>20} {'step ratio':>11}")
    for w in workloads:
        median = statistics.median(w.step_s)
        print(f"{w.name:>8} {w.registry.parked():>7} {median * 1e3:>17.3f} "
              f"{statistics.fmean(w.admit_s) * 1e6:>20.1f} {median / base:>10.2f}x")  # fmt: skip
    ratios = [statistics.median(w.step_s) / base for w in workloads[1:]]
    print(f"\nstep time with {args.parked} parked / with none: hot {ratios[0]:.2f}x, spread {ratios[1]:.2f}x "
          f"(target <= 1.1)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
