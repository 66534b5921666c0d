"""The Ray backend's driver: what it holds while a run's rows go through the stage.

Ray Data itself is real here (a local cluster, ``ray.data.range`` and the row maps of
:mod:`qmc_sampler.eval.backends.ray_backend`); the vLLM stage is replaced by a stand-in that answers
each row with a text naming the member it received, because what is measured is the
driver's own memory, not vLLM (``tests/eval/backends/test_ray.py`` runs the real stage on a cluster).
"""

import re
import tracemalloc

import pytest

pytest.importorskip("ray.data", reason="ray extra not installed: pip install 'qmc-llm-sampler[ray]'")

from qmc_sampler.eval.backends.generation import GroupJob, prompt_token_ids
from qmc_sampler.eval.backends.ray_backend import RayBackend
from qmc_sampler.eval.backends.ray_rows import member_output

#: 3 samplers × 261 problems × 64 members: 50,112 rows, the issue's run of 3 × 1,000 × 64 at a quarter size.
SAMPLERS, PROBLEMS, N = ("iid", "lattice", "sobol"), 261, 64
#: The driver's Python-heap peak (tracemalloc) allowed for that run. Measured: 2.35 MiB. The rows built up front,
#: as the driver did before, are ~1 KiB each (~50 MiB here), the completions kept to the end ~0.25 KiB (14.2 MiB
#: measured).
PEAK_BOUND = 8 * 2**20
#: What one more group of 64 may add to the peak: its place in the member table (~0.5 KiB measured); its
#: rows would be ~64 KiB, its completions kept ~16 KiB.
PER_GROUP_BOUND = 2 * 2**10


@pytest.fixture(scope="module")
def ray_local():
    import ray

    owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if owned:
        ray.shutdown()


def _answer(row: dict) -> dict:
    """The stand-in engine: a text that names the member the row asked for, the plugin's marker in params."""
    xargs = row["sampling_params"]["extra_args"]
    text = f"{xargs['qmc_group']}|{xargs['qmc_index']}|{xargs['qmc_n']}|{sum(int(t) for t in row['tokenized_prompt'])}"
    return {
        **row,
        "generated_text": text,
        "generated_tokens": [int(xargs["qmc_index"]) % 5],
        "params": "SamplingParams(n=1, extra_args={'_qmc': {}})",
        "request_id": int(row["qmc_member"]),  # as if each group had its own engine: request ids 0 … N-1
    }


class StandInStage(RayBackend):
    def stage(self):
        return lambda rows: rows.map(_answer).map(member_output)


def test_the_driver_holds_open_groups_only_not_the_runs_rows(ray_local, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 4, "stop": []}
    backend = StandInStage(tiny_model_dir, replicas=1, batch_size=1024)
    backend.connect()

    def peak(problems: int) -> int:
        """Run 3 × ``problems`` groups of N through the stand-in; return the driver's peak (checked)."""
        jobs = [
            GroupJob((s, f"p{i}", 0), None, f"problem {i}: the quick brown fox", N, 1000 * i + k, s, "id", sampling)
            for k, s in enumerate(SAMPLERS)
            for i in range(problems)
        ]
        sums = [sum(prompt_token_ids(tokenizer, job)) for job in jobs]
        index = {job.key: j for j, job in enumerate(jobs)}
        checked = bytearray(len(jobs))

        def on_group(job, members):
            j = index[job.key]
            expected = [f"{job.group_id}|{m}|{N}|{sums[j]}" for m in range(N)]
            checked[j] += [c.text for c in members] == expected

        tracemalloc.start()
        try:
            backend.run(jobs, on_group)
            _, top = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert bytes(checked) == b"\x01" * len(jobs)  # every group once, each member the row it asked for
        assert sum(backend.engine_rows) == len(jobs) * N and backend.duplicates == 0
        return top

    peak(2)  # Ray Data's modules imported, its workers started: not the driver's state
    small, large = peak(PROBLEMS // 10), peak(PROBLEMS)
    per_group = (large - small) / (len(SAMPLERS) * (PROBLEMS - PROBLEMS // 10))
    print(f"driver peak (tracemalloc) for {len(SAMPLERS) * PROBLEMS * N} rows: {large / 2**20:.2f} MiB "
          f"({small / 2**20:.2f} MiB for a tenth; {per_group:.0f} B more per group of {N})")  # fmt: skip
    assert large < PEAK_BOUND and per_group < PER_GROUP_BOUND, (large, per_group)


def test_a_cluster_busy_with_other_work_is_refused_at_once_naming_what_is_free(ray_local, tiny_model_dir):
    import ray
    from qmc_sampler.eval.backends.ray_backend import RayBackendError

    cpus = int(ray.cluster_resources()["CPU"])

    @ray.remote(num_cpus=cpus - 1)
    class OtherWork:
        def ready(self) -> bool:
            return True

    other = OtherWork.remote()
    ray.get(other.ready.remote())  # one CPU left: one replica and Ray Data's own tasks need two
    try:
        message = f"--replicas 1: the Ray cluster has 1 CPUs free ({cpus} in all) and no GPU; 1 CPU replicas need 2"
        with pytest.raises(RayBackendError, match=re.escape(message)):
            RayBackend(tiny_model_dir, replicas=1).connect()  # planned on the totals, it would wait for CPUs
    finally:
        ray.kill(other)
    # The other work gone (its CPUs come back a moment later), the same replica is planned.
    assert "1 vLLM replica(s) on CPU" in RayBackend(tiny_model_dir, replicas=1).connect()
