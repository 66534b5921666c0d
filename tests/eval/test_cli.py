"""``qmc-eval`` scoring commands and every bad input: one line, exit code 2."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from qmc_sampler.eval.cli import main


def write_samples(path, n=16, problems=5, samplers=("iid", "lattice"), groups=2, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for s in samplers:
            for p in range(problems):
                for g in range(groups):
                    for m in range(n):
                        f.write(
                            json.dumps(
                                {"problem": p, "sampler": s, "group": g, "member": m, "score": bool(rng.random() < 0.2)}
                            )
                            + "\n"
                        )
    return path


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr()


def test_passk_prints_a_table_with_the_bound(tmp_path, capsys):
    assert main(["passk", str(write_samples(tmp_path / "s.jsonl"))]) == 0
    out = capsys.readouterr().out
    assert "bound min(1,k·p̂)" in out and "lattice" in out and "iid" in out
    assert [line.split()[0] for line in out.splitlines()[2:7]] == ["1", "2", "4", "8", "16"]


def test_json_and_plot(tmp_path, capsys):
    samples = write_samples(tmp_path / "s.jsonl")
    png = tmp_path / "curve.png"
    assert main(["passk", str(samples), "--json", "--plot", str(png), "--k", "1,4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {d["sampler"] for d in data} == {"iid", "lattice"}
    assert set(data[0]["pass_at_k"]) == {"1", "4"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_docs_passk_recipe_scores_samples_made_elsewhere(tmp_path, capsys, monkeypatch, docs):
    (passk,) = docs.commands("qmc-eval-passk")
    monkeypatch.chdir(tmp_path)
    write_samples(tmp_path / "other_samples.jsonl")
    assert passk.argv[1:3] == ["-m", "qmc_sampler.eval"] and main(passk.argv[3:]) == 0
    assert {d["sampler"] for d in json.loads(capsys.readouterr().out)} == {"iid", "lattice"}


def test_score_reads_a_run_folder(tmp_path, capsys):
    write_samples(tmp_path / "samples.jsonl")
    assert main(["score", str(tmp_path)]) == 0
    assert "lattice" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"s.jsonl:3: not valid JSON"),
        ('{"problem": 1, "sampler": "iid", "member": 0}', r"s.jsonl:3: missing field 'score'"),
        ('{"problem": 1, "sampler": "iid", "member": "x", "score": 1}', r"s.jsonl:3: field 'member'='x' has the wrong"),
        ("[1, 2]", r"s.jsonl:3: expected a JSON object"),
    ],
)
def test_a_malformed_line_is_named_by_file_and_line(tmp_path, capsys, line, message):
    path = tmp_path / "s.jsonl"
    good = '{"problem": 0, "sampler": "iid", "member": %d, "score": true}\n'
    path.write_text(good % 0 + good % 1 + line + "\n")
    code, captured = run_cli(["passk", str(path)], capsys)
    assert code == 2
    assert len(captured.err.strip().splitlines()) == 1
    assert re.search(message, captured.err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["passk", "{samples}", "--k", "64"], "k=64 exceeds the group size N=16"),
        (["passk", "{samples}", "--k", "3"], "k=3 is not estimable for design 'lattice'"),
        (["passk", "{missing}"], "does not exist"),
        (["score", "{samples}"], "is not an output folder"),
        (["run", "--task", "nope", "--out", "x"], "'nope' is not a task; use one of basic_arithmetic"),
        (
            ["run", "--task", "basic_arithmetic", "--out", "x", "--model", "m", "--endpoint", "http://127.0.0.1:9"],
            "with --endpoint, name the served model",
        ),
        (["run", "--task", "maze", "--samplers", "iid,lattic", "--out", "x"], "unknown sampler 'lattic'"),
        (["run", "--task", "maze", "--n", "0", "--out", "x"], "argument --n: 0 must be >= 1"),
        (["run", "--task", "maze", "--temperature", "0", "--out", "x"], "--temperature=0.0 must be a finite number"),
        (["run", "--task", "maze", "--top-p", "2", "--out", "x"], "--top-p=2.0 must be in (0, 1]"),
        (["run", "--task", "maze", "--model", "{missing}", "--out", "x"], "is not a Hugging Face model folder"),
        (["run", "--task", "maze", "--task-option", "oops", "--out", "x"], "must look like key=value"),
        (["passk", "{samples}", "--k", "a,b"], "must be a comma-separated list of integers"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, argv, message):
    samples = write_samples(tmp_path / "s.jsonl")
    argv = [a.format(samples=samples, missing=tmp_path / "missing") for a in argv]
    code, captured = run_cli(argv, capsys)
    assert code == 2
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert message in captured.err


def test_stratified_is_only_scored_at_k_equals_n(tmp_path, capsys):
    samples = write_samples(tmp_path / "s.jsonl", samplers=("stratified",))
    assert main(["passk", str(samples)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:3]] == ["16"]
    code, captured = run_cli(["passk", str(samples), "--k", "4"], capsys)
    assert code == 2 and "use k = N = 16" in captured.err


def test_the_console_script_is_installed(tmp_path):
    exe = shutil.which("qmc-eval", path=os.path.dirname(sys.executable))
    assert exe is not None
    done = subprocess.run([exe, "passk", str(write_samples(tmp_path / "s.jsonl"))], capture_output=True, text=True)
    assert done.returncode == 0 and "lattice" in done.stdout


@pytest.fixture
def empty_model_cache(tmp_path, monkeypatch):
    """``$QMC_SAMPLER_CACHE`` as on a new machine: nothing converted yet."""
    cache = tmp_path / "model-cache"
    monkeypatch.setenv("QMC_SAMPLER_CACHE", str(cache))
    return cache


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ray", "--task", "jsonl:{missing}"], "missing.jsonl: no such task file"),
        (["--task", "jsonl:{tasks}", "--task-option", "max_tokens=0"], "--task-option max_tokens=0 must be an integer"),
        (["--task", "humaneval", "--task-option", "memory_mb=-1"], "--task-option memory_mb=-1 must be an integer"),
        (["--task", "basic_arithmetic", "--served-model", "m"], "--served-model: give --endpoint too"),
        (["--task", "basic_arithmetic", "--concurrency", "4"], "--concurrency: give --endpoint too"),
        (["--task", "basic_arithmetic", "--out", "{file}/sub"], "is a file, so the folder cannot be made"),
        # The endpoint is never asked: --out is refused first.
        (["--task", "basic_arithmetic", "--endpoint", "http://127.0.0.1:9", "--out", "{garbled}"], "settings file"),
        (["--ray", "--task", "basic_arithmetic", "--top-p", "2"], "--top-p=2.0 must be in (0, 1]"),
        (["--ray", "--task", "basic_arithmetic", "--task-option", "no_such_option=1"], "--task-option: "),
        (["--ray", "--task", "basic_arithmetic", "--out", "{other}"], "holds a run with other settings (n differ)"),
        (["--task", "basic_arithmetic", "--out", "{other}"], "holds a run with other settings (n differ)"),
        # Another release may draw other groups from the same seeds: its run is not continued.
        (["--task", "basic_arithmetic", "--n", "8", "--groups", "1", "--problems", "1", "--out", "{older}"],
         "holds a run with other settings (release differ)"),
        (["--task", "basic_arithmetic", "--out", "{file}"], "is a file; give a folder"),
        (["--task", "basic_arithmetic", "--out", "{garbled}"], "is not a run's settings file"),
    ],
)
def test_bad_run_options_are_refused_before_the_default_model_is_converted(
    tmp_path, capsys, empty_model_cache, argv, message
):
    pytest.importorskip("reasoning_gym", reason="eval extra not installed")
    other, garbled = tmp_path / "other", tmp_path / "garbled"
    other.mkdir()
    from qmc_sampler.eval.runs.runner import RunConfig

    settings = RunConfig("basic_arithmetic", ("iid", "lattice"), n=8, groups=1, problems=1, out="").identity()
    (other / "run.json").write_text(json.dumps(settings))
    older = tmp_path / "older"
    older.mkdir()
    (older / "run.json").write_text(json.dumps(settings | {"n": 8, "release": "0.1.0"}))
    garbled.mkdir()
    (garbled / "run.json").write_text("{not json")
    (tmp_path / "file").write_text("")
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "q", "prompt": "1 + 1 =", "answer": "2"}) + "\n")
    paths = {"missing": tmp_path / "missing.jsonl", "other": other, "older": older, "file": tmp_path / "file",
             "garbled": garbled, "tasks": tmp_path / "tasks.jsonl"}  # fmt: skip
    argv = [a.format(**paths) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    code, captured = run_cli(["run", "--quiet", "--n", "4", "--problems", "1", *argv], capsys)
    assert code == 2 and len(captured.err.strip().splitlines()) == 1 and message in captured.err, captured.err
    assert not empty_model_cache.exists(), sorted(empty_model_cache.rglob("*"))  # nothing converted, not even begun
    assert json.loads((other / "run.json").read_text())["n"] == 8  # nothing written over
