"""Load test on loopback: qmc-serve under concurrent n = 16 groups and a burst, vs vLLM's own server.

Three phases, each bounded in count and time; traffic never leaves the machine:

1. **goal** — ``--requests`` completions with ``n = 16`` (lattice), all sent at
   once to ``qmc-serve`` (``--max-members-in-flight`` = requests × 16, so all fit);
2. **burst** — 4 × ``--max-members-in-flight`` members at once to the same
   server: the ones beyond the limit must get a 429 (with ``Retry-After``), and
   nothing else may fail;
3. **vllm** — phase 1's load against vLLM's own OpenAI server with the plugin
   (``vllm_xargs: {"qmc_method": "lattice"}``), same model, dtype and threads.

Per phase: completed, expected 429s, other errors, p50/p99 latency and completion
tokens/s; then the ratio qmc-serve / vLLM for throughput and p50 latency. The
first line names the CPU.

    python benchmarks/server_load.py [--requests 64] [--n 16] [--max-tokens 32] [--model DIR] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"server did not start within {timeout} s")


@dataclass
class Phase:
    name: str
    latencies: list[float]
    refused: int  # 429s (expected in the burst)
    errors: int
    tokens: int
    wall: float

    def p(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")

    def line(self) -> str:
        return (
            f"{self.name:>6}: completed {len(self.latencies):4d}, 429s {self.refused:4d}, other errors {self.errors}, "
            f"p50 {statistics.median(self.latencies) if self.latencies else float('nan'):6.2f} s, "
            f"p99 {self.p(0.99):6.2f} s, {self.tokens / self.wall:7.1f} completion tokens/s, wall {self.wall:6.1f} s"
        )


async def load(name: str, base_url: str, requests: int, n: int, args: argparse.Namespace, vllm: bool) -> Phase:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=args.timeout)
    latencies: list[float] = []
    refused = errors = tokens = 0
    extra = {"vllm_xargs": {"qmc_method": "lattice"}} if vllm else {"sampler": "lattice"}

    async def one(i: int) -> None:
        nonlocal refused, errors, tokens
        start = time.monotonic()
        try:
            response = await client.completions.create(
                model="served",
                prompt=f"Question {i}: what is {i % 9} + {i % 7}? Answer:",
                n=n,
                max_tokens=args.max_tokens,
                temperature=1.0,
                extra_body=extra,
            )
            assert len(response.choices) == n
            tokens += response.usage.completion_tokens
            latencies.append(time.monotonic() - start)
        except openai.RateLimitError as e:
            refused += 1
            assert int(e.response.headers["Retry-After"]) >= 1
        except Exception as e:  # counted and reported, never retried
            errors += 1
            print(f"{name} request {i} failed: {e!r}", file=sys.stderr)

    start = time.monotonic()
    async with client:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(requests))), timeout=args.timeout)
    return Phase(name, latencies, refused, errors, tokens, time.monotonic() - start)


def serve(command: list[str], port: int, env: dict[str, str]) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_ready(f"http://127.0.0.1:{port}/health", process, timeout=300)
    return process


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--quick", action="store_true", help="4 requests of n = 4, 8 tokens: checks that it runs")
    args = p.parse_args()
    if args.quick:
        args.requests, args.n, args.max_tokens = 4, 4, 8
    import torch

    from qmc_sampler.cpu_defaults import cpu_engine_env, describe_cpu, engine_block_size, engine_dtype
    from qmc_sampler.models import resolve_model

    model = resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, why = engine_dtype("auto", device, model)
    block_size = engine_block_size(device_type=device)  # qmc-serve's default; vLLM's server gets the same
    blocks = ["--block-size", str(block_size)] if block_size is not None else []
    env = os.environ | {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": "2"} | cpu_engine_env()
    print(f"{describe_cpu()}; both servers: {dtype} ({why})", flush=True)
    limit = args.requests * args.n
    port = free_port()
    qmc = [sys.executable, "-m", "qmc_sampler.server.main", "--model", model, "--port", str(port),
           "--served-model-name", "served", "--dtype", dtype, "--max-n", str(args.n),
           "--max-members-in-flight", str(limit)]  # fmt: skip
    server = serve(qmc, port, env)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        goal = asyncio.run(load("goal", url, args.requests, args.n, args, vllm=False))
        print(goal.line(), flush=True)
        burst = asyncio.run(load("burst", url, 4 * limit // args.n, args.n, args, vllm=False))
        print(burst.line(), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    port = free_port()
    vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--served-model-name", "served", "--dtype", dtype, "--enforce-eager", *blocks]  # fmt: skip
    server = serve(vllm, port, env)
    try:
        theirs = asyncio.run(load("vllm", f"http://127.0.0.1:{port}/v1", args.requests, args.n, args, vllm=True))
        print(theirs.line(), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(
        f"\n{args.requests} concurrent requests of n = {args.n}, {args.max_tokens} tokens: qmc-serve / vLLM's server = "
        f"{(goal.tokens / goal.wall) / (theirs.tokens / theirs.wall):.2f}x throughput, "
        f"{statistics.median(goal.latencies) / statistics.median(theirs.latencies):.2f}x p50 latency"
    )
    expected_429s = burst.refused > 0 and burst.refused + len(burst.latencies) == 4 * limit // args.n
    ok = goal.errors == burst.errors == theirs.errors == 0 and expected_429s
    print("burst: " + ("only the expected 429s" if expected_429s else "UNEXPECTED: no 429 or lost requests"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
