"""Groups per second with 1 vs 2 endpoints: qmc-eval spreading members over replicas.

Starts two vLLM OpenAI servers with the plugin on loopback, each pinned to its own
core (``VLLM_CPU_OMP_THREADS_BIND``) — on a 2-core machine that is all there is —
and runs the same evaluation (default model, basic_arithmetic, lattice groups)
through :class:`~qmc_sampler.eval.endpoints.EndpointBackend`, first against one
endpoint, then against both, with the same concurrency. Prints groups/s for each
and the ratio; checks that both runs produced every member of every group, and
reports how many groups' texts are identical between the runs (bit-identical
only where a row's logits do not depend on its batch: see the README's
reproducibility section).

    python benchmarks/fleet_scaling.py [--problems 16] [--n 16] [--max-tokens 24] [--concurrency 32] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from server_load import free_port, wait_ready  # the same loopback helpers


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--problems", type=int, default=16)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="2 problems, n = 4, 8 tokens: checks that it runs")
    args = p.parse_args()
    if args.quick:
        args.problems, args.n, args.max_tokens, args.concurrency = 2, 4, 8, 4
    import torch
    from qmc_sampler.eval.endpoints import EndpointBackend
    from qmc_sampler.eval.runner import RunConfig, group_seed, jobs_for
    from qmc_sampler.eval.tasks import get_task

    from qmc_sampler.cpu_defaults import describe_cpu, engine_block_size, engine_dtype
    from qmc_sampler.models import resolve_model

    model = resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, why = engine_dtype("auto", device, model)
    block_size = engine_block_size(device_type=device)  # groups share their prompt's KV blocks
    blocks = ["--block-size", str(block_size)] if block_size is not None else []
    cores = sorted(os.sched_getaffinity(0))
    print(f"{describe_cpu()}; {dtype} ({why}); replica i pinned to core {cores[0]} / {cores[-1]}", flush=True)
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
        task = get_task("basic_arithmetic")
        problems = task.problems(args.problems, 0)
        config = RunConfig("basic_arithmetic", ("lattice",), args.n, 1, args.problems, "unused",
                           max_tokens=args.max_tokens)  # fmt: skip
        jobs = jobs_for(config, task, problems, set())
        assert jobs[0].seed == group_seed(0, "basic_arithmetic", problems[0].problem_id, 0)
        rates, results = {}, {}
        for count in (1, 2):
            backend = EndpointBackend(urls[:count], concurrency=args.concurrency)
            print(backend.connect(), flush=True)
            results[count] = texts = {}
            start = time.perf_counter()
            backend.run(jobs, lambda job, t, into=texts: into.__setitem__(job.key, t))
            rates[count] = len(jobs) / (time.perf_counter() - start)
            print(f"{count} endpoint(s): {len(jobs)} groups of n = {args.n} in {len(jobs) / rates[count]:.1f} s = "
                  f"{rates[count]:.2f} groups/s (retries: {backend.retries})", flush=True)  # fmt: skip
        complete = all(len(results[c]) == len(jobs) for c in (1, 2))
        identical = sum(results[1].get(key) == text for key, text in results[2].items())
        print(f"\nratio 2 / 1 endpoints: {rates[2] / rates[1]:.2f}x groups/s; every group complete: {complete}; "
              f"identical between the runs: {identical} of {len(results[2])} groups")  # fmt: skip
        return 0 if complete else 1
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
