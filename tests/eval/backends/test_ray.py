"""``qmc-eval run --ray``: a run's groups as rows of a Ray Dataset through Ray Data's vLLM stage.

One local Ray cluster serves the module (4 logical CPUs on this machine: two CPU engine replicas
of one CPU each, two for Ray Data's own tasks). Each pipeline runs as another driver connected by
address — the CLI, the docs' recipes (``eval/backends/ray_recipe.py``, ``eval/backends/ray_serve_recipe.py``) — and
each starts its own replicas (a Ray Data run's engines are its actors, ~30 s of CPU each here), so
one CLI run serves both the resume and the lost-replica checks. Every member is an explicit row, so
a group is one balanced group whichever replica serves each member; texts are never compared bit
for bit across batches or replicas (some CPUs give a row other logits in another batch), only what
holds across them: the same members, each once, balanced first tokens, the same verdicts.
"""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
pytest.importorskip("reasoning_gym", reason="eval extra not installed")
pytest.importorskip("ray.data.llm", reason="ray extra not installed: pip install 'qmc-llm-sampler[ray]'")

from qmc_sampler.eval.backends.ray_backend import RayBackend
from qmc_sampler.eval.runs.runner import RunConfig, run
from qmc_sampler.eval.runs.samples import read_samples

pytestmark = pytest.mark.vllm
#: The replicas' engines: the model in the actor's own process (no worker process to start, as the
#: suite's servers do), a 1 GiB KV cache each. The raylet passes them to every actor it starts; the
#: backend forwards these two from a driver's environment too (eval/backends/ray_plan.py FORWARDED_VLLM_ENV).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
#: Three plain prompts of the tiny model's corpus, each with a regex on its first token that holds
#: for a good share of samples (q ≈ 0.47, 0.67, 0.15), so correctness varies from member to member.
PROBLEMS = [
    {"id": "brown", "prompt": "the quick brown", "answer": "^ (seve|ten)"},
    {"id": "quartz", "prompt": "sphinx of black quartz", "answer": "^dg"},
    {"id": "box", "prompt": "pack my box with", "answer": "^vow"},
]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the module; yields its address (for drivers in other processes)."""
    import ray

    saved = {k: os.environ.get(k) for k in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)  # the raylet, and so every actor, inherits them
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def first_token_probs(hf_model, tokenizer):
    """q(first token | prompt) at a temperature, from the model itself (transformers, float64)."""
    import torch

    def probs(prompt_ids: list[int], temperature: float = 1.0) -> np.ndarray:
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt_ids])).logits[0, -1].double()
        return torch.softmax(logits / temperature, -1).numpy()

    return probs


def unbalanced(first_tokens: list[int], q: np.ndarray) -> dict[int, tuple[int, float]]:
    """Tokens whose count in a group of ``len(first_tokens)`` is neither ⌊n·q⌋ nor ⌈n·q⌉ (empty: balanced).

    A tolerance of 1e-3 on n·q absorbs the float32 engine against the float64 reference.
    """
    n, counts = len(first_tokens), Counter(first_tokens)
    tokens = set(counts) | {int(t) for t in np.flatnonzero(n * q >= 1 - 1e-3)}
    return {
        t: (counts[t], n * q[t])
        for t in tokens
        if not math.floor(n * q[t] - 1e-3) <= counts[t] <= math.ceil(n * q[t] + 1e-3)
    }


def qmc_eval(*args: str, timeout: float = 900, env: dict[str, str] | None = None, warm=None):
    """``python -m qmc_sampler.eval run --quiet ARGS`` in a new process, as a user runs it (what it
    prints, import-time warnings included, is what a user would see), or in a fork of ``warm`` (a
    :class:`warm_python.WarmPython`: torch and vLLM imported, ~5 s of CPU less)."""
    argv = ["-m", "qmc_sampler.eval", "run", "--quiet", *args]
    env = os.environ | ENGINE_ENV | (env or {})
    if warm is not None:
        return warm.run(argv, env=env, timeout=timeout)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)


def member_keys(records: list[dict]) -> list[tuple]:
    return [(r["sampler"], r["problem"], r["group"], r["member"]) for r in records]


def alive_replicas() -> list[dict]:
    """The stage's engine actors (Ray Data's ``MapWorker(MapBatches(vLLMEngineStageUDF))``) that are alive."""
    import ray

    return [
        a
        for a in ray._private.state.actors().values()
        if "vLLMEngineStageUDF" in a["ActorClassName"] and a["State"] == "ALIVE"
    ]


def kill_process_tree(pid: int) -> list[int]:
    """SIGKILL a process and everything it started (a replica's actor and its engine processes)."""
    import psutil

    process = psutil.Process(pid)
    victims = [process, *process.children(recursive=True)]
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.send_signal(signal.SIGKILL)
    return [v.pid for v in victims]


#: The CLI run: 3 problems × 2 samplers × GROUPS groups of 16 one-token members (a text is its first
#: token, so every lattice group's balance is checked exactly), long enough to lose a replica mid-run:
#: 94 batches of 16 rows (one group each) to generate, so at the kill (half the rows or more to come) 16
#: or more batches are still queued beyond the 2 × 16 Ray Data keeps in flight on the replicas
#: (2 × max_concurrent_batches each). Ray Data releases a replica that is idle once every batch is handed
#: out, and a released actor is not restarted: the kill must come before.
GROUPS = 16


def test_the_cli_on_two_replicas_resumes_a_run_loses_no_member_to_a_killed_replica_and_equals_the_in_process_run(
    ray_cluster, tiny_model_dir, llm_factory, tokenizer, first_token_probs, tmp_path, lm_eval_repeats, warm_python
):
    import ray

    tasks = tmp_path / "first_token.jsonl"
    tasks.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    config = RunConfig(
        task=f"jsonl:{tasks}", samplers=("iid", "lattice"), n=16, groups=GROUPS, problems=3,
        out=str(tmp_path / "local"), model=tiny_model_dir, max_tokens=1, task_options={"verifier": "regex"},
    )  # fmt: skip
    llm = llm_factory(tiny_model_dir, max_model_len=512)
    try:
        local = read_samples(run(config, engine=llm, progress=False) / "samples.jsonl")
    finally:
        llm.llm_engine.engine_core.shutdown()
    total = 2 * 3 * GROUPS * 16
    # The Ray run resumes a run cut after two groups (and a torn line): it generates the others, and one
    # of its two replicas is killed (with its engine) once a quarter of the rows are written.
    out = tmp_path / "ray"
    out.mkdir()
    shutil.copy(tmp_path / "local" / "run.json", out / "run.json")
    kept = (tmp_path / "local" / "samples.jsonl").read_text().splitlines(keepends=True)[: 2 * 16]
    (out / "samples.jsonl").write_text("".join(kept) + '{"task": "jso')
    argv = ["-m", "qmc_sampler.eval", "run", "--quiet", "--ray", ray_cluster, "--replicas", "2", "--task",
            f"jsonl:{tasks}", "--task-option", "verifier=regex", "--samplers", "iid,lattice", "--n", "16", "--groups",
            str(GROUPS), "--problems", "3", "--max-tokens", "1", "--model", tiny_model_dir,
            "--out", str(out)]  # fmt: skip
    log = tmp_path / "cli.log"
    cli = warm_python.start(argv, output=log, env=os.environ | ENGINE_ENV)
    try:
        samples, replicas = out / "samples.jsonl", []
        deadline = time.monotonic() + 600
        while len(replicas) < 2 and time.monotonic() < deadline:  # rows flow once both replicas are up
            assert cli.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
            replicas = alive_replicas()
        while (written := samples.read_text().count("\n")) <= total // 4 and time.monotonic() < deadline:
            assert cli.poll() is None, log.read_text()[-3000:]
            time.sleep(0.02)
        # Killed once a quarter of the rows are written (both replicas have very likely delivered by then:
        # killed at the first group, the victim had once delivered nothing and its restart came after the
        # survivor had done the rest, one engine's rows in all) with half the run or more to come, so each
        # replica holds batches (8 running, up to 16 in flight); every member written once below shows the
        # victim's lost batches ran again.
        replicas = alive_replicas()  # as they are at the kill
        assert len(replicas) == 2 and total // 4 < written <= total // 2, (replicas, written)
        victim = replicas[0]
        # The driver is stopped from the kill until Ray has taken up the victim's restart: with one-token rows
        # the survivor can finish the run before Ray handles the death, and a driver that ends takes its actors
        # (the victim, not yet restarted, with them).
        cli.send_signal(signal.SIGSTOP)
        try:
            kill_process_tree(victim["Pid"])
            restarts, until = 0, time.monotonic() + 60
            while not restarts and time.monotonic() < until:
                time.sleep(0.1)
                restarts = ray._private.state.actors(actor_id=victim["ActorID"])["NumRestarts"]
        finally:
            cli.send_signal(signal.SIGCONT)
        # Ray restarts the replica (its DeathCause otherwise says why not: released, or the job ended).
        assert restarts >= 1, ray._private.state.actors(actor_id=victim["ActorID"])
        assert cli.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if cli.poll() is None:  # (a failed check above: the driver and whatever it started go)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cli.pid, signal.SIGKILL)
    printed = log.read_text()
    assert "2 vLLM replica(s) on CPU (1 CPU each), float32" in printed
    assert "bound min(1,k·p̂)" in printed  # the pass@k table
    rows = [int(r) for r in printed.split("rows per vLLM engine: ")[1].split(";")[0].split(", ")]
    # Only the missing groups were generated, each row counted once (the killed replica's lost batches, never
    # delivered, are counted where they ran again), and both replicas served rows.
    assert sum(rows) == total - 2 * 16 and len(rows) >= 2, rows
    records = read_samples(out / "samples.jsonl")
    assert (out / "samples.jsonl").read_text().splitlines(keepends=True)[: 2 * 16] == kept  # resumed, not redone
    keys = member_keys(records)
    assert len(keys) == len(set(keys)) == total  # every member once: none lost, none written twice
    assert set(keys) == set(member_keys(local))  # the same members
    assert {r["finish_reason"] for r in records} <= {"stop", "length"}
    seeds = {(r["sampler"], r["problem"], r["group"]): r["group_seed"] for r in local}
    assert all(r["group_seed"] == seeds[r["sampler"], r["problem"], r["group"]] for r in records)
    by_id = {p["id"]: p for p in PROBLEMS}
    for problem in by_id:
        q = first_token_probs(tokenizer.encode(by_id[problem]["prompt"]))
        for group in range(GROUPS):
            key = ("lattice", problem, group)
            texts = [r["text"] for r in records if (r["sampler"], r["problem"], r["group"]) == key]
            assert len(texts) == 16 and not lm_eval_repeats.unbalanced(texts, q, tokenizer), (problem, group)
    verdicts = {k: r["score"] for k, r in zip(member_keys(local), local, strict=True)}
    agreement = np.mean([verdicts[k] == r["score"] for k, r in zip(keys, records, strict=True)])
    assert agreement >= 0.95 and 0 < np.mean([r["score"] for r in records]) < 1, agreement


def test_the_readme_ray_data_recipe_gives_one_group_across_replicas_and_one_per_replica(
    ray_cluster, tiny_model_dir, tokenizer, first_token_probs, warm_python
):
    # eval/backends/ray_recipe.py is the recipe the README shows, run as it is (on the tiny model's prompts).
    # 32 members of 96 tokens in batches of 4: a batch outlasts the arrival of the next, so the
    # explicit group's batches spread over both replicas.
    prompts = ["the quick brown", "sphinx of black quartz"]
    done = warm_python.run(
        ["-m", "qmc_sampler.eval.backends.ray_recipe", tiny_model_dir, "--address", ray_cluster,
         "--group-size", "32", "--max-tokens", "96", "--prompts", *prompts],
        env=os.environ | ENGINE_ENV, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"pattern"')]
    explicit = [r for r in rows if r["pattern"] == "explicit"]
    assert sorted(r["member"] for r in explicit) == list(range(32))
    # Explicit members: one balanced group, although two engines served its rows (each numbers its rows from 0).
    assert sum(r["request_id"] == 0 for r in explicit) == 2, sorted(r["request_id"] for r in explicit)
    q = first_token_probs(tokenizer.encode(prompts[0]))
    assert not unbalanced([r["tokens"][0] for r in explicit], q)
    # Repeats: each prompt's 32 rows are one batch, so on one replica, where the drop-in made them one group.
    for prompt in prompts:
        mine = [r for r in rows if r["pattern"] == "repeats" and r["prompt"] == prompt]
        where = {"batches": Counter(r["batch"] for r in mine), "rows": sorted(r["request_id"] for r in mine)}
        assert len(mine) == 32 and len(where["batches"]) == 1, (prompt, where)
        q = first_token_probs(tokenizer.encode(prompt))
        assert not unbalanced([r["tokens"][0] for r in mine], q), (prompt, where)


def test_bad_ray_options_are_one_line_and_exit_code_2(ray_cluster, http_helpers, tmp_path, warm_python):
    free_port, _ = http_helpers
    common = ["--task", "basic_arithmetic", "--n", "4", "--problems", "1", "--out", str(tmp_path / "bad")]
    cases = [
        (["--ray", "--replicas", "0"], "argument --replicas: 0 must be >= 1"),
        (["--replicas", "2"], "--replicas: give --ray too"),
        (["--ray", "--endpoint", "http://127.0.0.1:9"], "--ray: give either --ray or --endpoint"),
        (["--ray", f"127.0.0.1:{free_port()}"], "cannot connect to the Ray cluster (ConnectionError: nothing answers"),
        (["--ray", ray_cluster, "--replicas", "4"], "--replicas 4: the Ray cluster has 4 CPUs and no GPU"),
    ]
    cache = tmp_path / "model-cache"  # as on a new machine: the default model not converted yet
    for extra, message in cases:
        # The case that goes furthest (imports Ray, connects, plans) runs in a new process, as a user's
        # (import-time output included); the others in forks of the warm Python.
        cold = "has 4 CPUs" in message  # the longest path: connects to the cluster and plans the replicas
        done = qmc_eval(
            *common, *extra, timeout=300, env={"QMC_SAMPLER_CACHE": str(cache)}, warm=None if cold else warm_python
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (extra, done.stderr[-2000:])
        # (argparse's own errors name the subcommand: "qmc-eval run: error: …")
        assert len(lines) == 1 and lines[0].startswith("qmc-eval") and message in lines[0], (extra, lines)
        assert not cache.exists(), (extra, sorted(cache.rglob("*")))  # refused before any conversion


def test_without_a_model_the_default_one_is_found_once_the_cluster_is_checked(ray_cluster, tmp_path, monkeypatch):
    from qmc_sampler.eval.backends.ray_backend import RayBackendError

    from qmc_sampler.models import DEFAULT_MODEL_NAME, cache_root

    suite_cache = cache_root()  # (.ci/run: empty when the suite starts; one conversion serves every test)
    monkeypatch.setenv("QMC_SAMPLER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RayBackendError, match="--replicas 9: the Ray cluster has 4 CPUs"):
        RayBackend(None, replicas=9).connect()  # this process's cluster: too small, so nothing converted
    assert not (tmp_path / "cache").exists()
    monkeypatch.setenv("QMC_SAMPLER_CACHE", str(suite_cache))
    backend = RayBackend(None, replicas=2)
    assert "2 vLLM replica(s) on CPU" in backend.connect()  # (converted here if no test did before)
    assert (
        backend.model == str(suite_cache / DEFAULT_MODEL_NAME)
        and (suite_cache / DEFAULT_MODEL_NAME / "config.json").is_file()
    )


def test_ray_serve_llm_with_the_drop_in_serves_balanced_groups_on_cpu(
    ray_cluster, tiny_model_dir, tokenizer, first_token_probs, http_helpers, lm_eval_repeats, tmp_path, warm_python
):
    # eval/backends/ray_serve_recipe.py, the docs' Ray Serve LLM recipe, on this cluster: CPU replicas
    # (accelerator_config kind "cpu"), QMC_SAMPLER=lattice in their environment. Its driver is a
    # fork of the warm Python (torch and vLLM imported); the replicas are Ray's own processes.
    import httpx
    from ray import serve

    free_port, wait_for_http = http_helpers
    port = free_port()
    server = warm_python.start(
        ["-m", "qmc_sampler.eval.backends.ray_serve_recipe", tiny_model_dir, "--address", ray_cluster,
         "--port", str(port)],
        output=tmp_path / "serve.log", env=os.environ | ENGINE_ENV,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/v1/models", server, timeout=600, log=tmp_path / "serve.log")
        body = {"model": "model", "prompt": "the quick brown", "n": 32, "max_tokens": 1, "temperature": 1.0}
        choices = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"]
        texts = [c["text"] for c in choices]
        q = first_token_probs(tokenizer.encode("the quick brown"))
        assert len(texts) == 32 and not lm_eval_repeats.unbalanced(texts, q, tokenizer), texts  # one lattice group
        probe = {"model": "model", "prompt": "x", "max_tokens": 1, "vllm_xargs": {"qmc_method": "-probe-"}}
        refused = httpx.post(f"{url}/v1/completions", json=probe, timeout=120)
        assert refused.status_code == 400 and "'-probe-' is not a design" in refused.text  # the plugin admits requests
    finally:
        server.send_signal(signal.SIGTERM)  # the recipe takes its app down
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
        serve.shutdown()  # whatever of Serve is left on the module's cluster


def test_the_docs_ray_recipes_are_the_files_these_tests_run(docs):
    from pathlib import Path

    import qmc_sampler.eval.backends.ray_recipe as data
    import qmc_sampler.eval.backends.ray_serve_recipe as serve

    assert docs.python("ray-data-recipe") == Path(data.__file__).read_text()
    assert docs.python("ray-serve-recipe") == Path(serve.__file__).read_text()
