"""Load test of ``qmc-serve`` on loopback: concurrent n = 8 requests, latency percentiles.

Starts ``qmc-serve`` on 127.0.0.1 (the default model unless ``--model``), sends
``--requests`` completions with ``n = 8`` through the official ``openai`` async
client with at most ``--concurrency`` in flight, and prints p50/p99 latency,
throughput and the error count. Bounded in count and in time (``--timeout``);
traffic never leaves the machine.

    python benchmarks/server_load.py --requests 64 --concurrency 32 [--model DIR] [--max-tokens 32]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"qmc-serve exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"qmc-serve did not start within {timeout} s")


async def load(base_url: str, args: argparse.Namespace) -> tuple[list[float], int, int]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=args.timeout)
    gate = asyncio.Semaphore(args.concurrency)
    latencies: list[float] = []
    errors = 0
    tokens = 0

    async def one(i: int) -> None:
        nonlocal errors, tokens
        async with gate:
            start = time.monotonic()
            try:
                response = await client.completions.create(
                    model="served",
                    prompt=f"Question {i}: what is {i % 9} + {i % 7}? Answer:",
                    n=8,
                    max_tokens=args.max_tokens,
                    temperature=1.0,
                    extra_body={"sampler": "lattice"},
                )
                assert len(response.choices) == 8
                tokens += response.usage.completion_tokens
                latencies.append(time.monotonic() - start)
            except Exception as e:  # counted and reported, never retried
                errors += 1
                print(f"request {i} failed: {e!r}", file=sys.stderr)

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(args.requests))), timeout=args.timeout)
    return latencies, errors, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "qmc_sampler.server.main", "--port", str(port), "--served-model-name", "served"]
    if args.model:
        cmd += ["--model", args.model]
    env = os.environ | {"VLLM_LOGGING_LEVEL": "WARNING"}
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", server, timeout=300)
        start = time.monotonic()
        latencies, errors, tokens = asyncio.run(load(f"http://127.0.0.1:{port}/v1", args))
        wall = time.monotonic() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))] if latencies else float("nan")
    print(f"requests: {args.requests} (n = 8 each), concurrency {args.concurrency}, max_tokens {args.max_tokens}")
    print(f"completed: {len(latencies)}, errors: {errors}, wall: {wall:.1f} s")
    if latencies:
        print(f"latency p50: {statistics.median(latencies):.2f} s, p99: {p99:.2f} s, max: {latencies[-1]:.2f} s")
        print(f"throughput: {tokens / wall:.0f} completion tokens/s, {len(latencies) / wall:.2f} requests/s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
