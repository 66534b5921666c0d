"""The Ray backend's decisions that need no cluster: where replicas go, the rows it sends, what it
reads back (``tests/eval/test_ray.py`` runs it on a real one)."""

import pytest
from qmc_sampler.eval.generation import GroupJob, prompt_token_ids
from qmc_sampler.eval.ray_backend import (
    RayBackend,
    RayBackendError,
    ReplicaPlan,
    finish_reason,
    member_rows,
    plan_replicas,
    rows_per_engine,
)


def test_cpu_replicas_share_the_cpus_and_leave_some_to_ray_data():
    assert plan_replicas(2, 4, 0, 4, local=True) == ReplicaPlan("cpu", 2, 1)  # a local cluster made for them
    assert plan_replicas(2, 18, 0, 9, local=False) == ReplicaPlan("cpu", 2, 8)  # two CPUs left to Ray Data
    assert plan_replicas(3, 64, 0, 8, local=False) == ReplicaPlan("cpu", 3, 8)  # at most one node's CPUs
    assert plan_replicas(3, 4, 0, 4, local=False) == ReplicaPlan("cpu", 3, 1)  # one CPU left
    assert plan_replicas(1, 4, 0, 4, local=False, cpus_per_replica=1) == ReplicaPlan("cpu", 1, 1)


def test_gpu_clusters_get_one_gpu_per_replica():
    assert plan_replicas(4, 64, 8, 32, local=False) == ReplicaPlan("gpu", 4, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, 4, 0, 4), "--replicas 4: the Ray cluster has 4 CPUs and no GPU; 4 CPU replicas need 5"),
        ((3, 64, 2, 32), "--replicas 3: the Ray cluster has 2 GPUs; each replica needs one"),
    ],
)
def test_a_cluster_too_small_names_the_option(args, message):
    with pytest.raises(RayBackendError, match=message):
        plan_replicas(*args, local=False)
    with pytest.raises(RayBackendError, match="--replicas 2: "):
        plan_replicas(2, 4, 0, 4, local=False, cpus_per_replica=2)  # 2 × 2 CPUs and none for Ray Data


def test_rows_per_engine_reads_each_engines_count_off_the_request_ids():
    assert rows_per_engine([0, 1, 2, 3, 0, 1]) == [4, 2]  # engine a: 0..3, engine b: 0..1
    assert rows_per_engine(range(5)) == [5]
    assert rows_per_engine([]) == []


def test_finish_reason_follows_vllms_order_of_checks():
    eos = {2}
    assert finish_reason([5, 6, 2], "ab", 3, [], eos) == "stop"  # EOS on the last allowed token: stop first
    assert finish_reason([5, 6, 7], "abc", 3, [], eos) == "length"
    assert finish_reason([5, 6, 7], "x</answer>", 3, ["</answer>"], eos) == "stop"  # a stop string, kept
    assert finish_reason([5, 6], "x</answer>", 8, ["</answer>"], eos) == "stop"
    assert finish_reason([5], "a", 8, [], eos) == "stop"


def test_every_row_is_one_explicit_member_with_the_same_keys(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 4, "stop": []}
    jobs = [
        GroupJob(("lattice", 0, 0), [{"role": "user", "content": "hi"}], None, 4, 11, "lattice", "id", sampling),
        GroupJob(("iid", "p", 1), None, "the quick brown", 2, 12, "iid", "id", sampling),
    ]
    rows = member_rows(jobs, tokenizer)
    assert [(r["qmc_job"], r["qmc_member"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert len({tuple(sorted(r["sampling_params"]["extra_args"])) for r in rows}) == 1  # Arrow merges the structs
    assert all(v is not None for r in rows for v in r["sampling_params"]["extra_args"].values())
    last = rows[-1]["sampling_params"]
    assert last["n"] == 1 and last["include_stop_str_in_output"] and last["max_tokens"] == 4
    assert last["extra_args"] == {"qmc_method": "iid", "qmc_seed": 12, "qmc_order": "id",
                                  "qmc_group": "qmc-eval:iid:p:1", "qmc_index": 1, "qmc_n": 2}  # fmt: skip
    assert rows[0]["tokenized_prompt"] == prompt_token_ids(tokenizer, jobs[0])


def test_cpu_replicas_get_bundles_and_threads_gpu_replicas_the_stages_defaults(monkeypatch):
    pytest.importorskip("ray.data.llm", reason="ray extra not installed")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the driver's VLLM_* variables reach the replicas
    cpu = RayBackend("/models/m", replicas=2)
    cpu.plan, cpu._dtype_why = ReplicaPlan("cpu", 2, 3), ("float32", "")
    config = cpu.processor_config()
    assert config.concurrency == (2, 2) and config.log_engine_metrics is False
    assert [b["CPU"] for b in config.placement_group_config["bundles"]] == [3]  # (validated: GPU 0 added)
    env = config.runtime_env["env_vars"]
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert config.engine_kwargs["enforce_eager"] and config.engine_kwargs["dtype"] == "float32"
    gpu = RayBackend("/models/m", replicas=4)
    gpu.plan, gpu._dtype_why = ReplicaPlan("gpu", 4, 1), ("auto", "")
    config = gpu.processor_config()
    assert config.placement_group_config is None and "OMP_NUM_THREADS" not in config.runtime_env["env_vars"]
    assert "enforce_eager" not in config.engine_kwargs and config.concurrency == (4, 4)
