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

    :func:`open_records`, then the lines of runs without an ``end`` line are dropped so that those
    runs restart from their beginning (the file rewritten atomically, whole lines only).

    Args:
        path: the JSONL file. ident: :func:`grpo.plan.identity` of these arguments. p: for the error.

    Returns:
        The finished (design, seed) pairs.
    """
    records = open_records(path, ident, p, "grpo_steps.py")
    finished = {(r["design"], r["seed"]) for r in records if r.get("type") == END}
    kept = [r for r in records if r.get("type") == HEADER or (r.get("design"), r.get("seed")) in finished]
    if len(kept) != len(records):
        _rewrite(path, kept)
        print(f"dropped {len(records) - len(kept)} lines of unfinished runs; they restart", flush=True)
    return finished


def open_records(path: Path, ident: dict[str, Any], p: OneLineParser, script: str) -> list[dict[str, Any]]:
    """A new file gets the header line; an existing one must parse and carry the same identity (else a
    one-line error, exit 2), and a last line cut off mid-write (wherever it is) is dropped, the file
    rewritten atomically so that the next line appended starts a line.

    Args:
        path: the JSONL file. ident: the arguments' identity. p: for the error. script: named in it.

    Returns:
        The file's records, its header first.
    """
    if not path.exists():
        write_header(path, ident)
        return read_lines(path)[0]
    try:
        records, whole = read_lines(path)
    except ValueError as e:
        p.error(str(e))
    if not records or records[0].get("type") != HEADER:
        p.error(f"{path} has no header line: not a {script} file; use another --out")
    written = records[0]["identity"]
    if written != ident:
        diff = sorted(k for k in set(written) | set(ident) if written.get(k, "<missing>") != ident.get(k, "<missing>"))
        p.error(f"{path} was written with other arguments ({', '.join(diff)}); use another --out or the same ones")
    now, was = _versions(), records[0].get("versions", {})
    changed = sorted(k for k in now if was.get(k) != now[k])
    if changed:  # not refused (a patch release may change nothing), but never silent
        print(
            f"WARNING: {path} was started with other versions ("
            + ", ".join(f"{k} {was.get(k)} -> {now[k]}" for k in changed)
            + "): the runs it holds and the ones added now may differ by more than their seeds",
            file=sys.stderr,
            flush=True,
        )
    if not whole:
        _rewrite(path, records)
        print("dropped a last line cut off mid-write", flush=True)
    return records


def _rewrite(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``path`` by these records, atomically (a staging file renamed over it)."""
    staging = path.with_suffix(".tmp")
    staging.write_text("".join(json.dumps(r) + "\n" for r in records))
    staging.replace(path)


def run_cpu(end: dict[str, Any] | None, header: dict[str, Any]) -> str:
    """The CPU a finished run ran on: its end line's (written since runs of one file came from several
    machines), else the file's header's (the machine that started the file), else ``"unknown CPU"``.
    It is :func:`qmc_sampler.cpu_defaults.describe_cpu`'s line: the model and the cores a process may use
    (so a run under another ``taskset`` counts as another CPU), not ``QMC_FORCE_AVX2``'s ISA."""
    return (end or {}).get("cpu") or header.get("cpu") or "unknown CPU"


def write_header(path: Path, ident: dict[str, Any]) -> None:
    """Start the file ``path`` (and its folder) with its header line: the identity, the CPU, the versions."""
    from qmc_sampler.cpu_defaults import describe_cpu

    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"type": HEADER, "identity": ident, "cpu": describe_cpu(), "versions": _versions()}
    path.write_text(json.dumps(header) + "\n")


def append(path: Path, record: dict[str, Any]) -> None:
    """Add one record (a line, flushed: a cut-off run leaves whole lines behind it)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _versions() -> dict[str, str | None]:
    """The versions a header records: this package, torch, transformers, TRL and Python."""
    versions = {name: installed_version(name) for name in ("qmc-llm-sampler", "torch", "transformers", "trl")}
    return versions | {"python": sys.version.split()[0]}


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (None: not installed)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
