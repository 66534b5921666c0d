"""The server fuzz test, run long: many more random bodies against one live qmc-serve.

Runs ``tests/server/test_fuzz.py`` (hypothesis, derandomized) with ``QMC_FUZZ_EXAMPLES`` bodies
instead of the suite's 60: every sampler and vLLM sampling field with random values and types,
each answered 200 or 4xx, the server still serving and vLLM holding no request afterwards.
Traffic stays on loopback. Prints the CPU, the number of bodies and the wall time.

    python benchmarks/fuzz_server.py [--examples 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the report."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    """Run the fuzz test with ``--examples`` bodies; its exit status is the benchmark's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="random bodies to send (the suite sends 60)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples={args.examples} must be >= 1")
    print(f"CPU: {cpu_name()}; {args.examples} random bodies against one qmc-serve (tiny model)", flush=True)
    started = time.monotonic()
    env = os.environ | {"QMC_FUZZ_EXAMPLES": str(args.examples)}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
               str(ROOT / "tests" / "server" / "test_fuzz.py")]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env)
    verdict = "passed" if done.returncode == 0 else "FAILED"
    print(f"{args.examples} bodies in {time.monotonic() - started:.0f} s: {verdict}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
