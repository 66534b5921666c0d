"""Groups per second with 1 vs 2 replicas: qmc-eval's ``--endpoint`` fleet and its Ray backend side by side.

Two ways to spread the members of a run's groups over engine replicas, on the same
cores, the same evaluation (default model, basic_arithmetic, lattice groups) and the
same jobs:

* ``--endpoint``: two vLLM OpenAI servers with the plugin on loopback, each pinned to
  its own core (``VLLM_CPU_OMP_THREADS_BIND``), driven by
  :class:`~qmc_sampler.eval.backends.endpoints.EndpointBackend` — first one endpoint, then both;
* ``--ray``: Ray Data's vLLM stage (:class:`~qmc_sampler.eval.backends.ray_backend.RayBackend`) on a
  local Ray cluster, 1 then 2 replicas of one CPU each (``OMP_NUM_THREADS=1``, unbound threads).

The servers are stopped before the Ray runs, so each run has the cores to itself. Prints
one row per run — wall time, and groups/s once the engines run (the servers start before
their timing; the Ray replicas inside it, so their rate counts from when their actors are
alive) — and the 2/1 ratios; checks that every run produced every member of every group.
Texts are not compared between runs (another batch can give a row other logits on some
CPUs: see the reproducibility section of docs/designs.md).

    python benchmarks/fleet_scaling.py [--problems 16] [--n 16] [--max-tokens 24] [--concurrency 32]
        [--ray-replicas 1,2] [--quick]

``--quick`` (2 problems, n = 4, 8 tokens) checks that it runs: both endpoint runs, and no Ray run
unless ``--ray-replicas`` is given (a Ray run is mostly its replicas' start-up, ~30 s of CPU each
on a 2-core CPU; the Ray backend's own test, ``tests/eval/backends/test_ray.py``, starts three); a ratio not
measured is said so.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from server_load import free_port, wait_ready  # the same loopback helpers


def timed(backend, jobs, replicas_up=None) -> tuple[float, float, dict]:
    """Run ``jobs`` on ``backend``: (wall seconds, groups/s once the engines run, results).

    ``replicas_up`` (Ray): a function that blocks until the replicas' engines are up; the rate
    counts from then (the servers are up before the timing starts).
    """
    import threading

    results, up = {}, {}

    def on_group(job, completions) -> None:
        results[job.key] = completions

    if replicas_up is not None:
        watcher = threading.Thread(target=lambda: up.update(at=replicas_up()), daemon=True)
        watcher.start()
    start = time.perf_counter()
    backend.run(jobs, on_group)
    end = time.perf_counter()
    begin = up.get("at", start)
    return end - start, len(results) / (end - begin), results


def ray_replicas_up(count: int, timeout: float = 900) -> float:
    """When ``count`` engine actors of Ray Data's vLLM stage are alive (an actor is alive once its
    constructor, which starts the engine, returned): ``time.perf_counter()`` then."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        actors = ray._private.state.actors().values()  # the GCS's actor table (no dashboard needed)
        if sum("vLLMEngineStageUDF" in a["ActorClassName"] and a["State"] == "ALIVE" for a in actors) >= count:
            return time.perf_counter()
        time.sleep(0.1)
    return float("nan")


def replica_counts(text: str) -> tuple[int, ...]:
    """``--ray-replicas``: a comma-separated subset of 1, 2, in order."""
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        counts = ()
    if not counts or not set(counts) <= {1, 2} or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"{text!r}: give 1, 2 or 1,2")
    return tuple(sorted(counts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--problems", type=int, default=16)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--ray-replicas", type=replica_counts, default=None,
                   help="the Ray runs' replica counts, from 1, 2 (default: 1,2; with --quick: none)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="2 problems, n = 4, 8 tokens, no Ray run: that it runs")
    args = p.parse_args()
    if args.quick:
        args.problems, args.n, args.max_tokens, args.concurrency = 2, 4, 8, 4
    if args.ray_replicas is None:
        args.ray_replicas = () if args.quick else (1, 2)
    import torch
    from qmc_sampler.eval.backends.endpoints import EndpointBackend
    from qmc_sampler.eval.backends.ray_backend import RayBackend
    from qmc_sampler.eval.backends.ray_plan import SPARE_CPUS
    from qmc_sampler.eval.runs.runner import RunConfig, group_seed, jobs_for
    from qmc_sampler.eval.tasks.catalog import get_task

    from qmc_sampler.cpu_defaults import describe_cpu, engine_block_size, engine_dtype
    from qmc_sampler.models import resolve_model

    model = resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, why = engine_dtype("auto", device, model)
    block_size = engine_block_size(device_type=device)  # groups share their prompt's KV blocks
    blocks = ["--block-size", str(block_size)] if block_size is not None else []
    cores = sorted(os.sched_getaffinity(0))
    print(f"{describe_cpu()}; {dtype} ({why}); server i pinned to core {cores[0]} / {cores[-1]}", flush=True)
    task = get_task("basic_arithmetic")
    problems = task.problems(args.problems, 0)
    config = RunConfig("basic_arithmetic", ("lattice",), args.n, 1, args.problems, "unused", max_tokens=args.max_tokens)
    jobs = jobs_for(config, task, problems, set())
    assert jobs[0].seed == group_seed(0, "basic_arithmetic", problems[0].problem_id, 0)
    rows: list[tuple[str, int, float, float, bool]] = []  # (backend, replicas, wall s, groups/s, complete)

    servers, urls = [], []
    try:
        for core in (cores[0], cores[-1]):
            port = free_port()
            env = os.environ | {
                "VLLM_LOGGING_LEVEL": "WARNING",
                "VLLM_CPU_KVCACHE_SPACE": "2",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_OMP_THREADS_BIND": str(core),
            }
            command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port",
                       str(port), "--served-model-name", "served", "--dtype", dtype, "--enforce-eager",
                       *blocks]  # fmt: skip
            servers.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for server, url in zip(servers, urls, strict=True):
            wait_ready(f"{url}/health", server, timeout=300)
        for count in (1, 2):
            backend = EndpointBackend(urls[:count], concurrency=args.concurrency)
            print(backend.connect(), flush=True)
            wall, rate, results = timed(backend, jobs)
            rows.append(("--endpoint", count, wall, rate, len(results) == len(jobs)))
            print(f"  {len(jobs)} groups of n = {args.n} in {wall:.1f} s (retries: {backend.retries})", flush=True)
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=60)

    if args.ray_replicas:
        import ray

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # as the servers had; passed on to the replicas
        ray.init(num_cpus=2 + SPARE_CPUS, include_dashboard=False, log_to_driver=False)
        try:
            for count in args.ray_replicas:
                backend = RayBackend(model, replicas=count, dtype=dtype, cpus_per_replica=1)
                print(backend.connect(), flush=True)
                wall, rate, results = timed(backend, jobs, lambda count=count: ray_replicas_up(count))
                rows.append(("--ray", count, wall, rate, len(results) == len(jobs)))
                print(f"  {len(jobs)} groups of n = {args.n} in {wall:.1f} s (incl. starting the replicas); rows "
                      f"per engine: {backend.engine_rows}", flush=True)  # fmt: skip
        finally:
            ray.shutdown()

    print(f"\n{describe_cpu()}; {len(jobs)} lattice groups of n = {args.n}, {args.max_tokens} tokens, {dtype}")
    print(f"{'backend':<12}{'replicas':>9}{'cores':>7}{'wall s':>9}{'groups/s':>10}  complete")
    for name, count, wall, rate, complete in rows:
        print(f"{name:<12}{count:>9}{count:>7}{wall:>9.1f}{rate:>10.2f}  {complete}")
    rate = {(name, count): r for name, count, _, r, _ in rows}
    for name in ("--endpoint", "--ray"):
        if (name, 1) in rate and (name, 2) in rate:
            print(f"ratio 2 / 1 replicas, {name}: {rate[name, 2] / rate[name, 1]:.2f}x groups/s")
        else:
            print(f"ratio 2 / 1 replicas, {name}: not measured (replicas {sorted(c for n, c in rate if n == name)})")
    complete = all(row[-1] for row in rows)
    print(f"every group complete: {complete}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
