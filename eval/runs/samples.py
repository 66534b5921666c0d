"""The samples file: one JSON object per line, one line per sample.

Fields: ``task``, ``problem`` (id), ``sampler`` (design), ``group`` (index of the
group within the problem), ``group_seed``, ``member``, ``n`` (group size),
``text``, ``score`` (bool). A group's n lines are appended in one ``write`` and
flushed, so an interrupted run leaves at most one torn last line, which
:func:`read_samples` drops (``repair=True``) before a resumed run appends.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["REQUIRED", "SampleFileError", "append_group", "correct_arrays", "read_samples"]

REQUIRED = {"problem": (str, int), "sampler": (str,), "member": (int,), "score": (bool, int, float)}


class SampleFileError(ValueError):
    """A samples file that cannot be used; the message names the file and line."""


def append_group(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Append one group's records in a single write, then flush them to disk."""
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with open(path, "a", encoding="utf-8") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def read_samples(path: Path, *, repair: bool = False, skip_torn: bool = False) -> list[dict[str, Any]]:
    """Read and check a samples file.

    Args:
        path: the JSONL file.
        repair: drop a torn last line (an interrupted write) from the file instead of failing.
        skip_torn: pass over a torn last line, leaving the file as it is (to check whose file it is first).

    Raises:
        SampleFileError: ``"FILE:LINE: what is wrong"`` for the first bad line.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        torn = number == len(lines) and not line.endswith("\n")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if torn and (repair or skip_torn):
                if repair:
                    _truncate_torn_line(path, len(line.encode("utf-8")))
                break
            raise SampleFileError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise SampleFileError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        for field_name, types in REQUIRED.items():
            if field_name not in record:
                raise SampleFileError(f"{path}:{number}: missing field {field_name!r} (required: {sorted(REQUIRED)})")
            value = record[field_name]
            if not isinstance(value, types) or (field_name == "member" and isinstance(value, bool)):
                raise SampleFileError(f"{path}:{number}: field {field_name!r}={value!r} has the wrong type")
        if record["member"] < 0:
            raise SampleFileError(f"{path}:{number}: field 'member'={record['member']} must be >= 0")
        record.setdefault("group", 0)
        records.append(record)
    return records


def _truncate_torn_line(path: Path, length: int) -> None:
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        f.truncate(f.tell() - length)


@dataclass(frozen=True)
class ProblemGroups:
    """One (sampler, problem): its groups' correctness ``[groups, N]`` in member order."""

    sampler: str
    problem: str
    correct: np.ndarray


def correct_arrays(records: list[dict[str, Any]], source: str = "samples") -> list[ProblemGroups]:
    """Arrange records into per-(sampler, problem) ``[groups, N]`` arrays.

    Raises:
        SampleFileError: groups of unequal size, or missing/duplicate members.
    """
    cells: dict[tuple[str, str], dict[Any, dict[int, bool]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        members = cells[(r["sampler"], str(r["problem"]))][r["group"]]
        if r["member"] in members:
            raise SampleFileError(
                f"{source}: duplicate member {r['member']} in sampler {r['sampler']!r}, "
                f"problem {r['problem']!r}, group {r['group']!r}"
            )
        members[r["member"]] = bool(r["score"])
    out = []
    for (sampler, problem), groups in sorted(cells.items()):
        sizes = {len(g) for g in groups.values()}
        if len(sizes) != 1:
            raise SampleFileError(
                f"{source}: sampler {sampler!r}, problem {problem!r} has groups of sizes "
                f"{sorted(sizes)}; all groups of a problem need the same n"
            )
        n = sizes.pop()
        rows = []
        for key, g in sorted(groups.items(), key=lambda kv: str(kv[0])):
            if sorted(g) != list(range(n)):
                raise SampleFileError(
                    f"{source}: sampler {sampler!r}, problem {problem!r}, group {key!r} has "
                    f"members {sorted(g)[:8]}...; expected 0..{n - 1}"
                )
            rows.append([g[m] for m in range(n)])
        out.append(ProblemGroups(sampler, problem, np.array(rows, dtype=bool)))
    return out
