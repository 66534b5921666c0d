"""Sample until verified: grow each prompt's group in rounds, stop once ``want`` members pass.

Round j of a prompt sends members ``[j·r, (j+1)·r)`` (r = ``round_size``) and the
prompt stops once ``want`` of its members are verified correct, or at ``cap``
members. Two modes, which differ in what they guarantee (docs/evaluation.md,
"Sample until verified"):

* ``first`` (fewest samples): the rounds are consecutive members of *one* group of
  size 2^⌈log2 cap⌉ — for ``lattice`` the radical-inverse order, so every prefix of
  2^m members is a shifted lattice, and "solved within B samples" has the
  probability pass@B of the design's B-member prefix. Every member is an exact draw.
  The *first* ``want`` correct members, returned, are **not** distributed as
  p(· | correct) in general under a correlated design: which member comes first
  depends on where the others fell (tests/eval/runs/test_sequential.py measures it).
* ``unbiased``: every round is its own group of r members (its own seed), and
  every correct member of every round run is returned. Whether round j runs
  depends only on rounds before it, which are independent of it, so each
  returned sample counts as a draw from p(· | correct): the expected number of
  copies of each correct y is proportional to p(y). Keep them all — keeping only
  the first ``want`` of the last round brings the bias back.

i.i.d. (``design="iid"``) gives both guarantees in either mode.
:func:`sample_until` runs it on any backend with ``supports_rounds``
(:class:`~qmc_sampler.eval.backends.generation.InProcessBackend` on a ``vllm.LLM``,
:class:`~qmc_sampler.eval.backends.endpoints.EndpointBackend`, :class:`HostBackend` for a
logits function); every round of every unfinished prompt goes to the backend at
once, and the engine's prefix cache keeps each prompt's KV blocks between rounds.

With ``out``, a rerun resumes its own run only: every record carries the run's identity (seed,
order, sampling, prompts, verifier, want/cap/round_size/mode) and its group seed, and a file whose
records differ from this call's is refused naming what differs (:func:`run_identity`). Designs are
not part of it: one file may hold several designs' groups side by side (the same prompts and seeds,
as ``qmc-eval`` compares them), each resumed by its own call.

Longer than our ~400 lines on purpose: both modes share the round loop, and what each
guarantees is stated beside the code that keeps it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qmc_sampler.eval.backends.generation import Completion, GroupJob
from qmc_sampler.eval.runs.samples import append_group, read_samples

from qmc_sampler.designs import DESIGNS, get_design
from qmc_sampler.limits import MAX_GROUP_SIZE

__all__ = [
    "MODES",
    "HostBackend",
    "Member",
    "UntilResult",
    "check_until",
    "design_size",
    "round_job",
    "round_seed",
    "run_identity",
    "sample_until",
    "sequential_designs",
    "verifier_name",
]

#: ``first``: one extensible group, fewest samples; ``unbiased``: one group per round, every correct member kept.
MODES = ("first", "unbiased")


def sequential_designs() -> list[str]:
    """The designs a group can grow in rounds with: those whose members do not depend on the size."""
    return [name for name, d in DESIGNS.items() if d.extensible]


def check_until(want: int, cap: int, round_size: int, design: str, mode: str = "first") -> None:
    """Refuse settings a sequential run cannot honour, naming the setting.

    Raises:
        ValueError: ``want``, ``cap`` or ``round_size`` below 1, ``want`` or ``round_size`` above
            ``cap``, ``cap`` above the largest group, a design whose prefixes are not designs
            (``stratified``, ``arithmetic``), or an unknown mode.
    """
    for name, value in (("want", want), ("cap", cap), ("round_size", round_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if want > cap:
        raise ValueError(f"want={want} exceeds cap={cap}: a prompt can never have more correct members than it has")
    if round_size > cap:
        raise ValueError(f"round_size={round_size} exceeds cap={cap}")
    if cap > MAX_GROUP_SIZE // 2:
        raise ValueError(f"cap={cap} must be at most {MAX_GROUP_SIZE // 2}")
    get_design(design)
    if design not in sequential_designs():
        raise ValueError(
            f"design={design!r} cannot grow in rounds (a prefix of its group is not one of its designs); "
            f"use one of {sequential_designs()}"
        )
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a mode; use one of {list(MODES)}")


def design_size(cap: int) -> int:
    """The group size members are drawn from in ``first`` mode: 2^⌈log2 cap⌉, so a lattice's
    members are in radical-inverse order (every prefix of 2^m members a shifted lattice)."""
    return 1 << max(0, math.ceil(math.log2(cap)))


def round_seed(seed: int, round_index: int) -> int:
    """The seed of round ``round_index``'s own group in ``unbiased`` mode (round 0: ``seed`` itself)."""
    if round_index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}|round|{round_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def round_job(template: GroupJob, mode: str, cap: int, round_size: int, round_index: int, done: int) -> GroupJob:
    """The job of one round of a prompt's sequential group.

    Args:
        template: the prompt's job (key, prompt, method, seed, order, sampling); its n is ignored.
        mode: ``first`` or ``unbiased``; cap: the most members; round_size: members per round.
        round_index: which round; done: members generated so far (the round takes what the cap leaves).
    """
    from dataclasses import replace

    count = min(round_size, cap - done)
    sampler, problem, group = template.key
    key = (sampler, problem, group)
    if mode == "first":
        return replace(template, key=key, n=design_size(cap), first=done, count=count)
    # A round's group id names the round: members of different rounds are different groups.
    return replace(template, key=(sampler, problem, f"{group}.r{round_index}"), n=round_size,
                   seed=round_seed(template.seed, round_index), first=0, count=count)  # fmt: skip


@dataclass(frozen=True)
class Member:
    """One generated member: its round, its index in its group, text, verdict."""

    round: int
    member: int
    text: str
    correct: bool
    finish_reason: str | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class UntilResult:
    """One prompt's sequential group.

    Attributes:
        index: the prompt's place in the input; prompt: the prompt.
        members: every member generated, in generation order (round by round).
        want, cap, mode: the run's settings.
    """

    index: int
    prompt: Any
    members: tuple[Member, ...]
    want: int
    cap: int
    mode: str

    @property
    def spent(self) -> int:
        """Members generated (whole rounds: what the prompt cost)."""
        return len(self.members)

    @property
    def solved(self) -> bool:
        """At least ``want`` members are correct."""
        return sum(m.correct for m in self.members) >= self.want

    @property
    def samples_to_want(self) -> int | None:
        """How many members, in generation order, it took to reach ``want`` correct (None: not within the cap)."""
        hits = 0
        for position, m in enumerate(self.members, start=1):
            hits += m.correct
            if hits == self.want:
                return position
        return None

    @property
    def returned(self) -> list[Member]:
        """The samples the mode returns: ``first``, the first ``want`` correct members (exact members, but
        not distributed as p(· | correct) under a correlated design); ``unbiased``, every correct member."""
        correct = [m for m in self.members if m.correct]
        return correct[: self.want] if self.mode == "first" else correct


Verify = Callable[[Any, str], bool]


def sample_until(
    backend: Any,
    prompts: Sequence[Any],
    verify: Verify,
    *,
    want: int = 1,
    cap: int = 64,
    round_size: int = 8,
    design: str = "lattice",
    seed: int = 0,
    mode: str = "first",
    sampling: dict[str, Any] | None = None,
    order: str = "id",
    out: str | Path | None = None,
    progress: bool = True,
) -> list[UntilResult]:
    """Sample each prompt in rounds until ``want`` of its members are verified, or ``cap`` members.

    Args:
        backend: a ``vllm.LLM`` with the plugin, or a backend with ``supports_rounds``
            (:class:`~qmc_sampler.eval.backends.endpoints.EndpointBackend`, :class:`HostBackend`).
        prompts: text prompts, or chat message lists (``[{"role": …, "content": …}]``).
        verify: ``verify(prompt, text) -> bool``, called once per member.
        want: correct members to stop at; cap: the most members per prompt; round_size: members per round.
        design: ``lattice`` (default), ``iid``, ``sobol`` or ``antithetic``.
        seed: the run's seed (prompt i's group seed derives from it and i).
        mode: ``first`` (one group, fewest samples) or ``unbiased`` (a group per round, every correct
            member kept); the module docstring says what each guarantees.
        sampling: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``max_tokens``, ``stop``.
        order: vocabulary order of the design (``id`` or ``sorted``).
        out: a JSONL file written round by round; rerunning with the same file resumes this run
            (the same settings, prompts and verifier: :func:`run_identity`), and refuses another's.
        progress: show a bar over prompts.

    Returns:
        One :class:`UntilResult` per prompt, in input order.

    Raises:
        ValueError: bad settings (see :func:`check_until`), a backend that cannot serve rounds,
            or an ``out`` file written by another run (one line naming the settings that differ).
    """
    check_until(want, cap, round_size, design, mode)
    if not hasattr(backend, "supports_rounds") and hasattr(backend, "llm_engine"):
        from qmc_sampler.eval.backends.generation import InProcessBackend
        from qmc_sampler.vllm_engine.checks import require_plugin

        require_plugin(backend)
        backend = InProcessBackend(backend)
    if not getattr(backend, "supports_rounds", False):
        raise ValueError(f"backend {type(backend).__name__} cannot serve rounds (member ranges of a group)")
    templates = [
        GroupJob(
            key=(design, i, 0),
            messages=p if not isinstance(p, str) else None,
            prompt=p if isinstance(p, str) else None,
            n=cap,
            seed=prompt_seed(seed, i),
            method=design,
            order=order,
            sampling=dict(sampling or {}),
        )
        for i, p in enumerate(prompts)
    ]
    settings = {"want": want, "cap": cap, "round_size": round_size, "mode": mode} | run_identity(
        prompts, verify, seed=seed, sampling=sampling, order=order
    )

    def score(job: GroupJob, text: str) -> dict[str, Any]:
        return {"correct": bool(verify(prompts[job.key[1]], text))}

    records = run_rounds(templates, backend, score, settings, out=Path(out) if out else None, progress=progress)
    return [UntilResult(i, p, tuple(records[(design, i, 0)]), want, cap, mode) for i, p in enumerate(prompts)]


def prompt_seed(seed: int, index: int) -> int:
    """Prompt ``index``'s group seed, a 63-bit hash of (run seed, index)."""
    digest = hashlib.blake2b(f"{seed}|until|{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def run_identity(
    prompts: Sequence[Any],
    verify: Verify,
    *,
    seed: int,
    sampling: dict[str, Any] | None,
    order: str,
) -> dict[str, Any]:
    """What a :func:`sample_until` run records in every line of its ``out`` file, and a resume must match.

    Returns:
        JSON values: ``seed``, ``order``, ``sampling`` (as JSON writes it), ``prompts`` (their count
        and a SHA-256 of their JSON, in order) and ``verifier`` (:func:`verifier_name`). Each record
        also carries its design (``sampler``: records of other designs are other groups, left as they
        are) and its group seed, checked against the one this run derives.
    """
    text = json.dumps(list(prompts), sort_keys=True, ensure_ascii=False, default=repr)
    return {
        "seed": seed,
        "order": order,
        "sampling": _as_json(dict(sampling or {})),
        "prompts": f"{len(prompts)} prompts, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}",
        "verifier": verifier_name(verify),
    }


def verifier_name(verify: Any) -> str:
    """A verifier's recorded identity: the module and qualified name of a function or method, of a callable
    object's class, or of a ``functools.partial``'s function (its bound arguments' reprs appended).

    It names *which* verifier a file was scored with, not its code or state: a verifier edited under the
    same name (or two lambdas at one place) reads the same, so score an edited verifier into another file.
    """
    import functools

    if isinstance(verify, functools.partial):
        bound = [repr(a) for a in verify.args] + [f"{k}={v!r}" for k, v in sorted(verify.keywords.items())]
        return f"partial({verifier_name(verify.func)}{''.join(', ' + b for b in bound)})"
    named = verify if hasattr(verify, "__qualname__") else type(verify)
    return f"{getattr(named, '__module__', None) or '?'}.{named.__qualname__}"


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from a JSON line (tuples as lists; other objects by repr)."""
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


Score = Callable[[GroupJob, str], dict[str, Any]]


def run_rounds(
    templates: list[GroupJob],
    backend: Any,
    score: Score,
    settings: dict[str, Any],
    *,
    out: Path | None = None,
    extra: Callable[[GroupJob], dict[str, Any]] | None = None,
    progress: bool = True,
    console: Any = None,
) -> dict[tuple, list[Member]]:
    """The loop under :func:`sample_until` and ``qmc-eval run --until-correct``.

    Each round, every unfinished template gets its next round (:func:`round_job`); the
    backend runs them all, each completion is scored, and each finished round is appended
    to ``out`` in one write (resumable: rounds already in ``out`` are read back, not redone).

    Args:
        templates: one job per sequential group (its key names it).
        backend: has ``run(jobs, on_group)`` and ``supports_rounds``.
        score: ``score(job, text)`` → ``{"correct": bool, …}`` (other keys are written with the member).
        settings: ``want``, ``cap``, ``round_size``, ``mode`` and anything else that identifies the run
            (JSON values), written in every record and compared with the records already in ``out``.
        out: the JSONL file; extra: more fields for a template's records (task, problem id, …).

    Returns:
        The members of each template's key, in generation order.

    Raises:
        ValueError: ``out`` holds records of another run: other settings, or group seeds other than
            this run's (one line naming what differs).
    """
    from tqdm import tqdm

    want, cap, r, mode = settings["want"], settings["cap"], settings["round_size"], settings["mode"]
    members: dict[tuple, list[Member]] = {t.key: [] for t in templates}
    if out is not None and out.exists():
        _read_back(out, members, settings, {t.key: t for t in templates})

    def finished(key: tuple) -> bool:
        got = members[key]
        return len(got) >= cap or sum(m.correct for m in got) >= want

    bar = tqdm(total=len(templates), initial=sum(finished(t.key) for t in templates), unit="prompt",
               desc="until verified", disable=not progress, dynamic_ncols=True,
               file=None if console is None else console.err)  # fmt: skip
    spent = sum(len(v) for v in members.values())
    with bar:
        while True:
            active = [t for t in templates if not finished(t.key)]
            if not active:
                return members
            jobs, owner = [], {}
            before = {t.key: len(members[t.key]) for t in active}
            for t in active:
                done = len(members[t.key])
                job = round_job(t, mode, cap, r, done // r, done)
                jobs.append(job)
                owner[job.key] = t  # a round's key is unique (unbiased rounds name theirs)

            def on_round(job: GroupJob, completions: list[Completion], owner: dict = owner) -> None:
                nonlocal spent
                t = owner[job.key]
                j = len(members[t.key]) // r
                verdicts = [score(t, c.text) for c in completions]
                new = [Member(j, m, c.text, bool(v["correct"]), c.finish_reason, c.token_ids)
                       for m, c, v in zip(job.member_ids, completions, verdicts, strict=True)]  # fmt: skip
                if out is not None:
                    append_group(
                        out, [_record(t, job, x, v, settings, extra) for x, v in zip(new, verdicts, strict=True)]
                    )
                members[t.key].extend(new)
                spent += len(new)
                bar.set_postfix(members=spent, refresh=False)
                if finished(t.key):
                    bar.update(1)

            backend.run(jobs, on_round)
            short = [
                owner[j.key].key
                for j in jobs
                if len(members[owner[j.key].key]) != before[owner[j.key].key] + len(j.member_ids)
            ]
            if short:  # a backend that dropped a round would otherwise loop on it forever
                raise RuntimeError(f"the backend returned no round for {short[:3]} ({len(short)} prompts)")


def _record(
    template: GroupJob, job: GroupJob, m: Member, verdict: dict[str, Any], settings: dict[str, Any],
    extra: Callable[[GroupJob], dict[str, Any]] | None,
) -> dict[str, Any]:  # fmt: skip
    sampler, problem, group = template.key
    record = {
        "problem": problem,
        "sampler": sampler,
        "group": group,
        "round": m.round,
        "member": m.member,
        "group_seed": job.seed,
        "n": job.n,
        **settings,
        "text": m.text,
        "finish_reason": m.finish_reason,
        "score": m.correct,
        **{k: v for k, v in verdict.items() if k != "correct"},
    }
    return record | (extra(template) if extra else {})


def _read_back(
    out: Path, members: dict[tuple, list[Member]], settings: dict[str, Any], templates: dict[tuple, GroupJob]
) -> None:
    """Read the rounds already in ``out`` into ``members``, refusing records of another run (any
    setting, or a group seed, other than this run's); a torn last round is cut from the file."""
    by_key = {(str(k[0]), str(k[1]), str(k[2])): k for k in members}
    expected = _as_json(settings)
    mode = settings["mode"]
    rounds: dict[tuple, dict[int, list[Member]]] = {}
    # Another run's file is refused as it is: its torn last line, if any, is cut only once it is this run's.
    for number, rec in enumerate(read_samples(out, skip_torn=True), start=1):
        differ = [_differs(name, rec, value) for name, value in expected.items() if rec.get(name, _MISSING) != value]
        key = by_key.get((str(rec["sampler"]), str(rec["problem"]), str(rec.get("group", 0))))
        if key is not None and not differ:
            seed = templates[key].seed
            seed = seed if mode == "first" else round_seed(seed, int(rec["round"]))
            if rec.get("group_seed") != seed:
                differ.append(_differs("group_seed", rec, seed))
        if differ:
            raise ValueError(
                f"{out}:{number}: written by another run ({'; '.join(differ)}); "
                "use another file, or the same settings to resume"
            )
        if key is None:
            continue
        m = Member(
            int(rec["round"]), int(rec["member"]), rec.get("text", ""), bool(rec["score"]), rec.get("finish_reason")
        )
        rounds.setdefault(key, {}).setdefault(m.round, []).append(m)
    read_samples(out, repair=True)
    r, cap = settings["round_size"], settings["cap"]
    torn = set()  # an interrupted write can leave the first lines of a round: it is generated again
    for key, by_round in rounds.items():
        for j in sorted(by_round):
            if len(by_round[j]) != min(r, cap - j * r):
                torn.add((key, j))
                break
            members[key].extend(sorted(by_round[j], key=lambda x: x.member))
    if torn:
        kept = [rec for rec in read_samples(out) if (by_key.get((str(rec["sampler"]), str(rec["problem"]),
                str(rec.get("group", 0)))), int(rec["round"])) not in torn]  # fmt: skip
        partial = out.with_suffix(out.suffix + ".partial")
        partial.write_text("".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in kept), encoding="utf-8")
        partial.replace(out)


_MISSING = object()


def _differs(name: str, record: dict[str, Any], value: Any) -> str:
    """One setting a record differs in, for the refusal's one line."""
    if name not in record:
        return f"{name} not recorded (written before runs recorded it), this run's is {value!r}"
    return f"{name}={record[name]!r}, not {value!r}"


def load_until(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """A sequential samples file's records by (sampler, problem, group), in generation order."""
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault((str(r["sampler"]), str(r["problem"]), str(r.get("group", 0))), []).append(r)
    for v in out.values():
        v.sort(key=lambda r: (int(r.get("round", 0)), int(r["member"])))
    return out


class HostBackend:
    """Generate rounds on the host from a logits function (the reference loop of
    :func:`qmc_sampler.sample_group`, for any member range and many groups at once).

    Args:
        next_logits: ``next_logits(prompts, prefixes)`` → ``[rows, vocab]`` logits, row j for
            ``prompts[j]`` (the job's ``prompt`` or ``messages``) after the generated tokens ``prefixes[j]``.
        eos_token_id: a member stops after drawing it (included); decode: token ids → text
            (default: the ids as JSON).

    A job's ``sampling`` gives ``temperature``, ``top_k``, ``top_p``, ``min_p`` (vLLM's meanings)
    and ``max_tokens`` (16 if not given); ``stop`` strings are not applied.
    """

    supports_rounds = True

    def __init__(
        self,
        next_logits: Callable[[list[Any], list[list[int]]], Any],
        eos_token_id: int | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.next_logits = next_logits
        self.eos_token_id = eos_token_id
        self.decode = decode or json.dumps

    def run(self, jobs: Sequence[GroupJob], on_group: Callable[[GroupJob, list[Completion]], None]) -> None:
        """Generate every job's members, all rows batched step by step; call ``on_group`` per job."""
        import torch

        from qmc_sampler.group import GroupSpec, MemberState, sample_members
        from qmc_sampler.reference import validate_sampling

        rows = []  # (job index, state, tokens)
        for j, job in enumerate(jobs):
            s = job.sampling
            validate_sampling(s.get("temperature", 1.0), s.get("top_k", 0), s.get("top_p", 1.0), s.get("min_p", 0.0))
            spec = GroupSpec(job.method, job.n, job.seed, job.order)
            rows += [(j, MemberState(spec=spec, member=m), []) for m in job.member_ids]
        steps = max((job.sampling.get("max_tokens") or 16) for job in jobs) if jobs else 0
        active = list(range(len(rows)))
        for _ in range(steps):
            active = [i for i in active if len(rows[i][2]) < (jobs[rows[i][0]].sampling.get("max_tokens") or 16)]
            if not active:
                break
            logits = self.next_logits([jobs[rows[i][0]].prompt if jobs[rows[i][0]].messages is None
                                       else jobs[rows[i][0]].messages for i in active],
                                      [list(rows[i][2]) for i in active])  # fmt: skip
            settings = [jobs[rows[i][0]].sampling for i in active]
            draw = sample_members(
                logits,
                [rows[i][1] for i in active],
                torch.tensor([float(s.get("temperature", 1.0)) for s in settings]),
                torch.tensor([max(int(s.get("top_k", 0)), 0) for s in settings]),
                torch.tensor([float(s.get("top_p", 1.0)) for s in settings]),
                torch.tensor([float(s.get("min_p", 0.0)) for s in settings]),
            )
            still = []
            for i, tok in zip(active, draw.tokens.tolist(), strict=True):
                rows[i][2].append(tok)
                if tok != self.eos_token_id:
                    still.append(i)
            active = still
        by_job: dict[int, list[Completion]] = {}
        for j, _, tokens in rows:
            stopped = self.eos_token_id is not None and tokens[-1:] == [self.eos_token_id]
            by_job.setdefault(j, []).append(
                Completion(self.decode(tokens), "stop" if stopped else "length", tuple(tokens))
            )
        for j, job in enumerate(jobs):
            on_group(job, by_job.get(j, []))
