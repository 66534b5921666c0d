"""``steps.jsonl``: a header line, a line per (design, seed, step), an ``end`` line per finished run; its resume."""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from grpo.plan import OneLineParser

HEADER, STEP, END = "header", "step", "end"


def read_lines(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The records of ``path``, and whether its text is whole: every line a record, the last
    one ended by a newline. A last line cut off mid-write is dropped (its run is unfinished).

    Raises:
        ValueError: the file is not text, or a line before the last is not a JSON object.
    """
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a text file ({e}); use another --out") from None
    records = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif i != len(lines) - 1:
            raise ValueError(
                f"{path}, line {i + 1}: not a JSON record (only the last line may be cut off); use another --out"
            )
    return records, len(records) == len(lines) and text.endswith("\n")


def open_results(path: Path, ident: dict[str, Any], p: OneLineParser) -> set[tuple[str, int]]:
    """Prepare ``path`` for this invocation and say which (design, seed) runs are finished.

    A new file gets the header line. An existing one must carry the same identity and parse
    (else a one-line error, exit 2); the lines of runs without an ``end`` line are dropped
    so that those runs restart from their beginning, and so is a last line cut off
    mid-write (wherever it is: after a run's ``end`` line too). Either way the file is
    rewritten atomically, whole lines only, so that the next line appended starts a line.

    Args:
        path: the JSONL file. ident: :func:`grpo.plan.identity` of these arguments. p: for the error.

    Returns:
        The finished (design, seed) pairs.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        from qmc_sampler.cpu_defaults import describe_cpu

        versions = {name: _version(name) for name in ("qmc-llm-sampler", "torch", "transformers", "trl")}
        versions["python"] = sys.version.split()[0]
        header = {"type": HEADER, "identity": ident, "cpu": describe_cpu(), "versions": versions}
        path.write_text(json.dumps(header) + "\n")
        return set()
    try:
        records, whole = read_lines(path)
    except ValueError as e:
        p.error(str(e))
    if not records or records[0].get("type") != HEADER:
        p.error(f"{path} has no header line: not a grpo_steps.py file; use another --out")
    if records[0]["identity"] != ident:
        diff = sorted(k for k in ident if records[0]["identity"].get(k) != ident[k])
        p.error(f"{path} was written with other arguments ({', '.join(diff)}); use another --out or the same ones")
    finished = {(r["design"], r["seed"]) for r in records if r.get("type") == END}
    kept = [r for r in records if r.get("type") == HEADER or (r.get("design"), r.get("seed")) in finished]
    if len(kept) != len(records) or not whole:
        staging = path.with_suffix(".tmp")
        staging.write_text("".join(json.dumps(r) + "\n" for r in kept))
        staging.replace(path)
        if not whole:
            print("dropped a last line cut off mid-write", flush=True)
        if len(kept) != len(records):
            print(f"dropped {len(records) - len(kept)} lines of unfinished runs; they restart", flush=True)
    return finished


def append(path: Path, record: dict[str, Any]) -> None:
    """Add one record (a line, flushed: a cut-off run leaves whole lines behind it)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _version(name: str) -> str | None:
    """The installed version of distribution ``name`` (None: not installed)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
