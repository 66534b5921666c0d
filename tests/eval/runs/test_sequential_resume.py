"""``sample_until(out=F)`` resumes its own run and refuses another's (issue 50, item 3).

Every record of F carries the run's identity (seed, order, sampling, prompts, verifier, and
want/cap/round_size/mode) and its group seed; a call whose identity differs is refused in one line
naming what differs, with F left as it was. Before, only want/cap/round_size/mode were compared:
another seed got the first run's samples back, other prompts and another verifier got the old
prompts' members with the old verdicts, and an interrupted run resumed with another seed mixed two
groups. Runs on the tabular toy model of tests/conftest.py (exact, no engine).
"""

import functools
import json

import pytest
from qmc_sampler.eval.runs.sequential import HostBackend, sample_until

PROMPTS = [f"p{i}" for i in range(12)]
SETTINGS = dict(want=2, cap=8, round_size=2, sampling={"max_tokens": 3}, progress=False)


def verify(prompt, text):
    return sum(json.loads(text)) % 3 == 0


def verify_other(prompt, text):
    return sum(json.loads(text)) % 2 == 0


@pytest.fixture
def logits(toy_model):
    def next_logits(prompts, prefixes):
        return toy_model.batched_logits([tuple(p) for p in prefixes])

    return next_logits


def view(results):
    """Everything a result says: each prompt's members with their rounds, texts and verdicts."""
    return [(r.index, r.prompt, [(m.round, m.member, m.text, m.correct) for m in r.members]) for r in results]


def lines(path):
    return sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda r: (r["problem"], r["member"]))


OTHER_RUNS = [
    ("seed", {"seed": 1}, "seed=0, not 1"),
    ("prompts", {"prompts": [f"q{i}" for i in range(12)]}, "prompts='12 prompts, sha256 [0-9a-f]+', not '12 prompts"),
    ("fewer prompts", {"prompts": PROMPTS[:6]}, "prompts='12 prompts, .*', not '6 prompts"),
    ("reordered prompts", {"prompts": PROMPTS[::-1]}, "prompts="),
    ("verifier", {"verify": verify_other}, r"verifier='[\w.]*verify', not '[\w.]*verify_other'"),
    ("sampling", {"sampling": {"max_tokens": 3, "temperature": 0.7}}, r"sampling=\{'max_tokens': 3\}, not"),
    ("order", {"order": "sorted"}, "order='id', not 'sorted'"),
    ("mode", {"mode": "unbiased"}, "mode='first', not 'unbiased'"),
    ("want", {"want": 1}, "want=2, not 1"),
]


@pytest.mark.parametrize(("what", "change", "match"), OTHER_RUNS, ids=[c[0] for c in OTHER_RUNS])
def test_a_finished_file_is_refused_to_another_run_naming_what_differs(logits, tmp_path, what, change, match):
    out = tmp_path / "until.jsonl"
    sample_until(HostBackend(logits), PROMPTS, verify, out=out, **SETTINGS)
    before = out.read_text()
    call = {"prompts": PROMPTS, "verify": verify} | SETTINGS | change
    prompts, verifier = call.pop("prompts"), call.pop("verify")
    with pytest.raises(ValueError, match=rf"until.jsonl:1: written by another run \(.*{match}") as info:
        sample_until(HostBackend(logits), prompts, verifier, out=out, **call)
    message = str(info.value)
    assert "\n" not in message and "use another file, or the same settings to resume" in message
    assert out.read_text() == before  # nothing read into the other run, nothing appended


def test_an_interrupted_run_resumed_with_another_seed_is_refused(logits, tmp_path, interrupting):
    out = tmp_path / "until.jsonl"
    with pytest.raises(KeyboardInterrupt):
        sample_until(interrupting(logits, 1), PROMPTS, verify, out=out, **SETTINGS)
    before = out.read_text()
    assert before  # one round of every prompt
    with pytest.raises(ValueError, match=r"seed=0, not 7\)"):
        sample_until(HostBackend(logits), PROMPTS, verify, out=out, seed=7, **SETTINGS)
    assert out.read_text() == before


@pytest.mark.parametrize("mode", ["first", "unbiased"])
@pytest.mark.parametrize("rounds", [1, 2])
def test_an_interrupted_run_resumed_as_itself_is_the_uninterrupted_run(logits, tmp_path, mode, rounds, interrupting):
    whole_out, out = tmp_path / "whole.jsonl", tmp_path / "until.jsonl"
    settings = SETTINGS | {"mode": mode, "seed": 3, "order": "sorted"}
    whole = sample_until(HostBackend(logits), PROMPTS, verify, out=whole_out, **settings)
    with pytest.raises(KeyboardInterrupt):
        sample_until(interrupting(logits, rounds), PROMPTS, verify, out=out, **settings)
    written = out.read_text().splitlines()
    assert 0 < len(written) < sum(r.spent for r in whole)
    out.write_text("\n".join(written[:-1]) + "\n" + written[-1][:10])  # a torn last round
    resumed = sample_until(HostBackend(logits), PROMPTS, verify, out=out, **settings)
    assert view(resumed) == view(whole)
    assert lines(out) == lines(whole_out)  # every member once, with the uninterrupted run's record
    again = sample_until(HostBackend(logits), PROMPTS, verify, out=out, **settings)  # finished: read back only
    assert view(again) == view(whole) and lines(out) == lines(whole_out)


def test_a_record_with_another_group_seed_is_refused(logits, tmp_path):
    out = tmp_path / "until.jsonl"
    sample_until(HostBackend(logits), PROMPTS, verify, out=out, **SETTINGS)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    records[3]["group_seed"] += 1  # say, a file whose seeds were derived otherwise
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(
        ValueError, match=rf"until.jsonl:4: written by another run \(group_seed={records[3]['group_seed']}"
    ):
        sample_until(HostBackend(logits), PROMPTS, verify, out=out, **SETTINGS)


def test_a_file_from_before_runs_recorded_their_identity_is_refused(logits, tmp_path):
    out = tmp_path / "until.jsonl"
    sample_until(HostBackend(logits), PROMPTS, verify, out=out, **SETTINGS)
    old = ("want", "cap", "round_size", "mode", "problem", "sampler", "group", "round", "member", "group_seed", "n",
           "text", "finish_reason", "score")  # fmt: skip
    records = [{k: v for k, v in json.loads(x).items() if k in old} for x in out.read_text().splitlines()]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=r"seed not recorded \(written before runs recorded it\), this run's is 0"):
        sample_until(HostBackend(logits), PROMPTS, verify, out=out, **SETTINGS)


def test_designs_side_by_side_in_one_file_each_resume_their_own_groups(logits, tmp_path):
    out = tmp_path / "until.jsonl"
    first = {d: view(sample_until(HostBackend(logits), PROMPTS, verify, design=d, out=out, **SETTINGS))
             for d in ("iid", "lattice")}  # fmt: skip
    size = len(out.read_text().splitlines())
    for design, results in first.items():
        assert view(sample_until(HostBackend(logits), PROMPTS, verify, design=design, out=out, **SETTINGS)) == results
    assert len(out.read_text().splitlines()) == size
    with pytest.raises(ValueError, match="seed=0, not 1"):  # a design's groups still belong to this run
        sample_until(HostBackend(logits), PROMPTS, verify, design="sobol", seed=1, out=out, **SETTINGS)


class Checker:
    def __call__(self, prompt, text):
        return True

    def check(self, prompt, text):
        return True


def test_a_verifier_is_recorded_by_its_qualified_name():
    from qmc_sampler.eval.runs.sequential import verifier_name

    here = __name__
    assert verifier_name(verify) == f"{here}.verify"
    assert verifier_name(Checker()) == f"{here}.Checker"
    assert verifier_name(Checker().check) == f"{here}.Checker.check"
    assert verifier_name(functools.partial(verify, "p")) == f"partial({here}.verify, 'p')"
    assert (
        verifier_name(lambda p, t: True)
        == f"{here}.test_a_verifier_is_recorded_by_its_qualified_name.<locals>.<lambda>"
    )


def test_another_runs_torn_file_is_refused_as_it_is(logits, tmp_path, interrupting):
    # Its torn last line may be that run's write in progress: refused first, cut only for its own run.
    out = tmp_path / "until.jsonl"
    with pytest.raises(KeyboardInterrupt):
        sample_until(interrupting(logits, 1), PROMPTS, verify, out=out, **SETTINGS)
    written = out.read_text().splitlines()
    out.write_text("\n".join(written[:-1]) + "\n" + written[-1][:10])
    before = out.read_text()
    with pytest.raises(ValueError, match=r"seed=0, not 7\)"):
        sample_until(HostBackend(logits), PROMPTS, verify, out=out, seed=7, **SETTINGS)
    assert out.read_text() == before
