"""``qmc-eval run --endpoint``: groups generated on served models, spread over replicas.

Two real servers of the tiny model, both requiring an API key: A is vLLM's own
OpenAI server with the plugin, B is ``qmc-serve`` (the same server with its
middleware, which must pass explicit members through). Because every member is sent as an explicit
member of its group, a run over A and B, a run over A alone and a run in-process
give the same samples when each member is computed alone (one in flight: a pinned
batch); and killing a replica mid-run must still complete the run on the other,
every group written exactly once and whole. ``qmc-eval run --until-correct`` runs its docs
recipe on A as it does in-process.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
pytest.importorskip("reasoning_gym", reason="eval extra not installed")
from qmc_sampler.eval.cli import main as cli_main
from qmc_sampler.eval.runs.runner import RunConfig, run
from qmc_sampler.eval.runs.samples import read_samples

pytestmark = pytest.mark.vllm
KEY = "fleet-key-0a8b"
SETTINGS = ["--task", "basic_arithmetic", "--samplers", "iid,lattice", "--n", "4", "--problems", "3",
            "--max-tokens", "6", "--temperature", "1.5"]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, serve, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet")
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    vllm_server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_dir,
                   "--served-model-name", "tiny", "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32",
                   "--max-model-len", "512", "--api-key", KEY]  # fmt: skip
    qmc_serve = [sys.executable, "-m", "qmc_sampler.server.main", "--model", tiny_model_dir, "--served-model-name",
                 "tiny", "--kv-cache-gb", "1", "--max-model-len", "512", "--dtype", "float32"]  # fmt: skip
    with (
        serve(vllm_server, logs / "vllm.log", env) as a,
        serve(qmc_serve, logs / "qmc-serve.log", env | {"QMC_SERVE_API_KEY": KEY}) as b,
    ):
        yield {"a": a, "b": b}


@pytest.fixture
def qmc_eval(warm_python):
    """``qmc_eval(*args, key=KEY, timeout=600, cold=False)``: ``python -m qmc_sampler.eval run --quiet
    ARGS`` in a fresh interpreter, the API key in its environment: a fork of the warm one, or with
    ``cold`` a new process as a user's (what a bad option prints is all a user would see)."""

    def run_cli(*args, key=KEY, timeout=600, cold=False):
        env = os.environ | {"QMC_EVAL_API_KEY": key} if key else None
        argv = ["-m", "qmc_sampler.eval", "run", "--quiet", *args]
        if cold:
            return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)
        return warm_python.run(argv, env=env, timeout=timeout)

    return run_cli


def samples(out: Path) -> set[tuple]:
    return {
        (r["sampler"], r["problem"], r["group"], r["member"], r["text"]) for r in read_samples(out / "samples.jsonl")
    }


def recipe(command, env=None) -> list[str]:
    """A docs recipe's ``qmc-eval run`` arguments (after ``run``; ``$VAR`` from ``env``) for :func:`qmc_eval`."""
    assert command.argv[1:4] == ["-m", "qmc_sampler.eval", "run"], command.argv
    return command.expanded(env or {})[4:]


def test_a_group_over_two_replicas_equals_one_replica_and_the_in_process_engine(
    fleet, qmc_eval, llm_factory, tiny_model_dir, tmp_path, docs
):
    # One member in flight at a time everywhere: each member is computed in a batch of one, so the
    # texts are comparable bit for bit (in mixed batches some CPUs give a row other logits).
    # The runs are docs/evaluation.md's recipes, with this test's smaller settings after them.
    (_, url_a), (_, url_b) = fleet["a"], fleet["b"]
    (spread,) = docs.commands("qmc-eval-fleet", {"http://node-a:8000": url_a, "http://node-b:8000": url_b,
                                                 "my-model": "tiny", "runs/fleet": str(tmp_path / "both")})  # fmt: skip
    both = qmc_eval(*recipe(spread), *SETTINGS, "--concurrency", "1")
    assert both.returncode == 0, both.stderr[-2000:]
    assert f"2 endpoint(s): {url_a}, {url_b}" in both.stdout
    (served,) = docs.commands("qmc-eval-endpoint", {"http://gpu-box:8000": url_a, "my-model": "tiny",
                                                    "runs/served": str(tmp_path / "one")})  # fmt: skip
    one = qmc_eval(*recipe(served, {"KEY": KEY}), *SETTINGS, "--concurrency", "1")
    assert one.returncode == 0, one.stderr[-2000:]
    llm = llm_factory(tiny_model_dir, max_model_len=512)
    try:
        config = RunConfig(
            task="basic_arithmetic", samplers=("iid", "lattice"), n=4, groups=1, problems=3,
            out=str(tmp_path / "local"), max_tokens=6, temperature=1.5, max_members_in_flight=1,
        )  # fmt: skip
        local = run(config, engine=llm, progress=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert samples(tmp_path / "both") == samples(tmp_path / "one") == samples(local)
    assert len(samples(local)) == 2 * 3 * 4 and len({s[-1] for s in samples(local)}) > 4


def test_the_docs_jsonl_recipe_runs_on_a_served_model(fleet, qmc_eval, docs, tmp_path):
    (_, url_a) = fleet["a"]
    task, command = docs.commands("qmc-eval-jsonl", {"my.jsonl": str(tmp_path / "my.jsonl"),
                                                     "runs/mine": str(tmp_path / "mine")})  # fmt: skip
    Path(task.file[0]).write_text(task.file[1])
    done = qmc_eval(*recipe(command), "--endpoint", url_a, "--served-model", "tiny", "--n", "4", "--max-tokens", "6")
    assert done.returncode == 0, done.stderr[-2000:]
    records = read_samples(tmp_path / "mine" / "samples.jsonl")
    assert len(records) == 2 * 2 * 4 and {r["problem"] for r in records} == {"q1", "q2"}


def test_the_bad_input_matrix_is_one_line_and_exit_code_2(fleet, qmc_eval, http_helpers, tmp_path):
    free_port, _ = http_helpers
    (_, url_a), (_, url_b) = fleet["a"], fleet["b"]
    cases = [
        (["--endpoint", f"http://127.0.0.1:{free_port()}"], KEY, "is unreachable (ConnectError"),
        (["--endpoint", url_a, "--served-model", "no-such-model"], KEY, "model 'no-such-model' is not served by"),
        (["--endpoint", url_b], "wrong-key", "refused the API key (HTTP 401)"),
        (["--endpoint", url_a], "wrong-key", "refused the API key (HTTP 401)"),
    ]
    for i, (extra, key, message) in enumerate(cases):
        # The first in a new process, as a user's (import-time output included: every case imports the
        # same modules before it fails); the others in forks of the warm Python, ~5 s of CPU less each.
        done = qmc_eval(*SETTINGS, *extra, "--out", str(tmp_path / "bad"), key=key, cold=i == 0)
        assert done.returncode == 2, (extra, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("qmc-eval: error:") and message in lines[0], (extra, lines)


UNTIL_SMALLER = ["--n", "8", "--round-size", "2", "--problems", "3", "--max-tokens", "6", "--temperature", "1.5"]


def until_members(out):
    return {(r["sampler"], r["problem"], r["round"], r["member"], r["text"], r["score"])
            for r in read_samples(out / "samples.jsonl")}  # fmt: skip


def test_the_docs_until_recipe_runs_on_a_served_model_as_in_process(
    fleet, docs, llm_factory, tiny_model_dir, tmp_path, warm_python
):
    # `qmc-eval run --until-correct` over HTTP: rounds are explicit members, served like any other.
    # With one member in flight everywhere both runs give the same members, rounds and stopping
    # points, and `qmc-eval score` reads the folder.
    (_, url_a) = fleet["a"]
    (command,) = docs.commands("qmc-eval-until", {"runs/until": str(tmp_path / "served")})
    assert command.argv[1:4] == ["-m", "qmc_sampler.eval", "run"], command.argv
    done = warm_python.run(
        [*command.argv[1:], *UNTIL_SMALLER, "--endpoint", url_a, "--concurrency", "1", "--quiet"],
        env=os.environ | {"QMC_EVAL_API_KEY": KEY},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "samples to 1 correct (cap 8, rounds of 2)" in done.stdout and "lattice / iid" in done.stdout
    llm = llm_factory(tiny_model_dir, max_model_len=512)
    try:
        config = RunConfig(
            task="basic_arithmetic", samplers=("iid", "lattice"), n=8, groups=1, problems=3,
            out=str(tmp_path / "local"), max_tokens=6, temperature=1.5, max_members_in_flight=1,
            until_correct=1, round_size=2,
        )  # fmt: skip
        local = run(config, engine=llm, progress=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    served = until_members(tmp_path / "served")
    assert served == until_members(local)
    # Groups grew past their first round (the tiny random model rarely answers), in rounds of 2.
    assert {m[2] for m in served} >= {0, 1} and all(m[3] // 2 == m[2] for m in served)
    assert cli_main(["score", str(tmp_path / "served"), "--json", "--resamples", "200"]) == 0


# Long enough to lose a replica in the middle (it is lost once 3 of the 16 groups are written):
# 2 samplers × 8 problems × 8 members.
MID_RUN_PROBLEMS = 8
MID_RUN = ["--task", "basic_arithmetic", "--samplers", "iid,lattice", "--n", "8", "--problems",
           str(MID_RUN_PROBLEMS), "--max-tokens", "24", "--temperature", "1.5"]  # fmt: skip


@contextlib.contextmanager
def run_under_way(qmc_eval, settings, endpoints, out):
    """``qmc-eval run`` over ``endpoints`` in a thread; the body runs once some groups are written.

    Yields a dict that holds the finished run's ``result`` after the block.
    """
    done: dict = {}
    targets = [arg for url in endpoints for arg in ("--endpoint", url)]
    runner = threading.Thread(target=lambda: done.update(result=qmc_eval(*settings, *targets, "--out", str(out))))
    runner.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # three groups are written: the run is under way
        path = out / "samples.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= 3 * 8:
            break
        time.sleep(0.2)
    try:
        yield done
    finally:  # (also when the body failed: the next test must not meet this run in the warm Python)
        runner.join(timeout=600)


def assert_every_group_once_and_complete(out):
    """Every member of every group written once, none lost, each a whole sample (never cut off).

    Texts are not compared with a one-replica run: a retried member runs in another batch,
    and on some CPUs a row's logits depend on its batch, which the carry amplifies (the
    member is still an exact draw, of other tokens).
    """
    records = read_samples(out / "samples.jsonl")
    keys = [(r["sampler"], r["problem"], r["group"], r["member"]) for r in records]
    assert len(keys) == len(set(keys)) == 2 * MID_RUN_PROBLEMS * 8  # every group once, none lost, none duplicated
    groups = {k[:3] for k in keys}
    assert all(sorted(k[3] for k in keys if k[:3] == g) == list(range(8)) for g in groups)
    assert {r["finish_reason"] for r in records} <= {"stop", "length"}  # no truncated text recorded as a sample


def test_killing_a_replica_mid_run_completes_on_the_other(fleet, qmc_eval, tmp_path):
    (process_a, url_a), (_, url_b) = fleet["a"], fleet["b"]
    out = tmp_path / "killed"
    settings = [*MID_RUN, "--concurrency", "4"]
    with run_under_way(qmc_eval, settings, [url_a, url_b], out) as done:
        os.killpg(process_a.pid, signal.SIGKILL)  # the server and its engine processes, at once
    result = done["result"]
    assert result.returncode == 0, result.stderr[-2000:]
    retried = int(result.stdout.split(" requests retried")[0].split()[-1])
    assert retried > 0  # the dead replica's requests went to the other one
    assert_every_group_once_and_complete(out)
    assert json.loads((out / "run.json").read_text())["model"] == "tiny"


def test_a_replica_shut_down_mid_run_has_its_cut_off_members_retried(fleet, qmc_eval, serve, tiny_model_dir, tmp_path):
    # qmc-serve answers the members it aborts on SIGTERM with finish_reason "abort" and their text so
    # far: those are not samples, and must be generated again on the other replica.
    (_, url_b) = fleet["b"]
    out = tmp_path / "drained"
    settings = [*MID_RUN, "--concurrency", "8"]
    command = [sys.executable, "-m", "qmc_sampler.server.main", "--model", tiny_model_dir, "--served-model-name",
               "tiny", "--kv-cache-gb", "1", "--max-model-len", "512", "--dtype", "float32",
               "--shutdown-timeout", "0"]  # fmt: skip
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "QMC_SERVE_API_KEY": KEY}
    with serve(command, tmp_path / "c.log", env) as (process_c, url_c):
        with run_under_way(qmc_eval, settings, [url_b, url_c], out) as done:
            process_c.send_signal(signal.SIGTERM)
            assert process_c.wait(timeout=60) == 0
    result = done["result"]
    assert result.returncode == 0, result.stderr[-2000:]
    assert_every_group_once_and_complete(out)
