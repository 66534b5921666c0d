"""``qmc-eval run --until-correct``'s options and ``qmc-eval passk/score`` of a sequential run.

Option errors are checked before any model is found (one line, exit code 2); the report is
read from a samples file written by :func:`sample_until` on the toy model (exact draws).
"""

import json

import pytest
from qmc_sampler.eval.cli import main
from qmc_sampler.eval.runs.sequential import HostBackend, sample_until

BASE = ["run", "--task", "basic_arithmetic", "--problems", "2", "--n", "8"]


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (["--round-size", "4"], "--round-size: give --until-correct"),
        (["--until-correct", "9"], "--until-correct 9 exceeds --n 8"),
        (["--until-correct", "1", "--round-size", "16"], "--round-size 16 exceeds --n 8"),
        (["--until-correct", "1", "--samplers", "iid,stratified"], "--samplers: 'stratified' cannot grow"),
        (["--until-correct", "1", "--ray"], "--until-correct: not with --ray"),
        (["--until-correct", "0"], "--until-correct"),
    ],
)
def test_bad_options_are_one_line_and_exit_code_2(extra, names, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QMC_SAMPLER_CACHE", str(tmp_path / "empty-cache"))  # nothing may be converted
    with pytest.raises(SystemExit) as e:
        main([*BASE, "--out", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and names in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "empty-cache").exists()


def test_score_reports_samples_to_k_with_intervals_and_the_ratio(toy_model, tmp_path, capsys):
    out = tmp_path / "samples.jsonl"

    def logits(prompts, prefixes):
        return toy_model.batched_logits([tuple(p) for p in prefixes])

    def verify(prompt, text):
        return sum(json.loads(text)) % 3 == 0

    prompts = [f"p{i}" for i in range(48)]
    for design in ("iid", "lattice"):
        sample_until(HostBackend(logits), prompts, verify, want=1, cap=8, round_size=2, design=design,
                     sampling={"max_tokens": 3}, out=out, progress=False)  # fmt: skip
    assert main(["passk", str(out), "--json", "--resamples", "300"]) == 0
    reports = {r["sampler"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(reports) == {"iid", "lattice"}
    records = [json.loads(x) for x in out.read_text().splitlines()]
    for sampler, r in reports.items():
        firsts = []
        for i in range(48):
            hits = [x["score"] for x in records if x["sampler"] == sampler and x["problem"] == i]
            firsts.append(hits.index(True) + 1 if True in hits else 8)
        mean = r["samples_to_want_capped_mean"]
        assert mean["value"] == pytest.approx(sum(firsts) / 48)
        assert mean["ci_low"] < mean["value"] < mean["ci_high"]
        solved = [
            True in [x["score"] for x in records if x["sampler"] == sampler and x["problem"] == i] for i in range(48)
        ]
        assert r["solve_rate"]["8"]["value"] == pytest.approx(sum(solved) / 48) and r["solved"] == sum(solved)
        assert r["solve_rate"]["1"]["value"] == pytest.approx(sum(f == 1 for f in firsts) / 48)
        assert set(r["solve_rate"]) == {str(b) for b in range(1, 9)}
    ratio = reports["lattice"]["ratio_to_iid_capped_mean"]
    assert ratio["value"] == pytest.approx(
        reports["lattice"]["samples_to_want_capped_mean"]["value"]
        / reports["iid"]["samples_to_want_capped_mean"]["value"]
    )
    assert ratio["ci_low"] < ratio["value"] < ratio["ci_high"] and reports["iid"]["ratio_to_iid_capped_mean"] is None
    assert main(["passk", str(out), "--resamples", "300"]) == 0
    table = capsys.readouterr().out
    assert "samples to 1 correct (cap 8, rounds of 2)" in table and "lattice / iid" in table
    with pytest.raises(SystemExit) as e:
        main(["passk", str(out), "--k", "2"])
    assert e.value.code == 2 and "sequential run" in capsys.readouterr().err
