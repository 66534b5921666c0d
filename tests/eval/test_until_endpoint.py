"""``qmc-eval run --until-correct`` over HTTP: rounds are explicit members, served like any other.

One real server of the tiny model (vLLM's OpenAI server with the plugin). The docs' recipe, with
smaller settings, runs against it and in-process; with one member in flight everywhere (each
member computed in a batch of one, as tests/eval/test_endpoints.py does) both runs give the same
members, rounds and stopping points, and ``qmc-eval score`` reads the folder.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
pytest.importorskip("reasoning_gym", reason="eval extra not installed")
from qmc_sampler.eval.cli import main as cli_main
from qmc_sampler.eval.runner import RunConfig, run
from qmc_sampler.eval.samples import read_samples

pytestmark = pytest.mark.vllm
SMALLER = ["--n", "8", "--round-size", "2", "--problems", "3", "--max-tokens", "6", "--temperature", "1.5"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve, tmp_path_factory):
    logs = tmp_path_factory.mktemp("until-server")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_dir,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32",
               "--max-model-len", "512"]  # fmt: skip
    with serve(command, logs / "vllm.log", os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}) as (_, url):
        yield url


def members(out):
    return {(r["sampler"], r["problem"], r["round"], r["member"], r["text"], r["score"])
            for r in read_samples(out / "samples.jsonl")}  # fmt: skip


def test_the_docs_until_recipe_runs_on_a_served_model_as_in_process(
    server, docs, llm_factory, tiny_model_dir, tmp_path
):
    (command,) = docs.commands("qmc-eval-until", {"runs/until": str(tmp_path / "served")})
    assert command.argv[1:4] == ["-m", "qmc_sampler.eval", "run"], command.argv
    done = subprocess.run(
        [*command.argv, *SMALLER, "--endpoint", server, "--concurrency", "1", "--quiet"],
        capture_output=True, text=True, timeout=600,
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
    served = members(tmp_path / "served")
    assert served == members(local)
    # Groups grew past their first round (the tiny random model rarely answers), in rounds of 2.
    assert {m[2] for m in served} >= {0, 1} and all(m[3] // 2 == m[2] for m in served)
    assert cli_main(["score", str(tmp_path / "served"), "--json", "--resamples", "200"]) == 0
