"""The Ray backend's decisions that need no cluster: where replicas go, the rows it sends, what it
reads back (``tests/eval/backends/test_ray.py`` runs it on a real one)."""

import sys

import pytest
from qmc_sampler.eval.backends.generation import GroupJob, prompt_token_ids
from qmc_sampler.eval.backends.ray_backend import RayBackend
from qmc_sampler.eval.backends.ray_plan import (
    FORWARDED_VLLM_ENV,
    RayBackendError,
    ReplicaPlan,
    cpu_replica,
    plan_replicas,
    recipe_parser,
    replica_env,
)
from qmc_sampler.eval.backends.ray_rows import MemberTable, finish_reason, rows_per_engine


def nodes(*cpus_gpus: tuple[float, float]) -> list[dict[str, float]]:
    """Nodes' resources as Ray reports them (a resource with none left is absent)."""
    return [{"CPU": c, **({"GPU": g} if g else {})} for c, g in cpus_gpus]


def total(free: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(node.get(key, 0) for node in free) for key in ("CPU", "GPU")}


def plan(replicas, free, *, all_of=None, local=False, **options):
    return plan_replicas(replicas, free, total(all_of or free), local=local, **options)


def test_cpu_replicas_share_the_cpus_and_leave_some_to_ray_data():
    assert plan(2, nodes((4, 0)), local=True) == ReplicaPlan("cpu", 2, 1)  # a local cluster made for them
    assert plan(2, nodes((9, 0), (9, 0))) == ReplicaPlan("cpu", 2, 8)  # two CPUs left to Ray Data
    assert plan(3, nodes(*[(8, 0)] * 8)) == ReplicaPlan("cpu", 3, 8)  # at most one node's CPUs
    assert plan(3, nodes((4, 0))) == ReplicaPlan("cpu", 3, 1)  # one CPU left
    assert plan(1, nodes((4, 0)), cpus_per_replica=1) == ReplicaPlan("cpu", 1, 1)
    # Each bundle on one node: of 16 free CPUs on nodes of 7, 7 and 2, three replicas of 4 would need a third
    # node with 4; they get 3 each (two on each node of 7).
    assert plan(3, nodes((7, 0), (7, 0), (2, 0))) == ReplicaPlan("cpu", 3, 3)


def test_replicas_are_planned_on_the_free_resources_not_the_clusters_total():
    busy = nodes((2, 0), (1, 0))  # 18 CPUs in all, 15 taken by other work
    assert plan(2, busy, all_of=nodes((9, 0), (9, 0))) == ReplicaPlan("cpu", 2, 1)
    with pytest.raises(
        RayBackendError, match=r"--replicas 3: the Ray cluster has 3 CPUs free \(18 in all\) and no GPU"
    ):
        plan(3, busy, all_of=nodes((9, 0), (9, 0)))
    gpus_busy = nodes((32, 1), (32, 0))  # 8 GPUs in all, 7 taken
    with pytest.raises(RayBackendError, match=r"--replicas 2: the Ray cluster has 1 GPUs free \(8 in all\); each "
                       r"replica needs one; --ray-device cpu: CPU replicas"):  # fmt: skip
        plan(2, gpus_busy, all_of=nodes((32, 4), (32, 4)))


def test_gpu_clusters_get_one_gpu_per_replica_unless_cpu_replicas_are_asked_for():
    assert plan(4, nodes((32, 4), (32, 4))) == ReplicaPlan("gpu", 4, 1)
    assert plan(4, nodes((32, 4), (32, 4)), device="gpu") == ReplicaPlan("gpu", 4, 1)
    assert plan(4, nodes((32, 4), (32, 4)), device="cpu") == ReplicaPlan("cpu", 4, 15)
    assert plan(2, nodes((4, 0)), device="cpu") == ReplicaPlan("cpu", 2, 1)
    # A GPU shared with other work (0.5 free) holds no replica; a node with 1.5 free GPUs holds one.
    assert plan(1, nodes((8, 0.5), (8, 1.5))) == ReplicaPlan("gpu", 1, 1)
    with pytest.raises(RayBackendError, match="--replicas 2: the Ray cluster has 1 GPUs free"):
        plan(2, nodes((8, 0.5), (8, 1.5)), all_of=nodes((8, 1), (8, 2)))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, nodes((4, 0))), "--replicas 4: the Ray cluster has 4 CPUs and no GPU; 4 CPU replicas need 5"),
        ((3, nodes((32, 2), (32, 0))), "--replicas 3: the Ray cluster has 2 GPUs; each replica needs one"),
        ((2, nodes((4, 0)), {"device": "gpu"}), "--ray-device gpu: the Ray cluster has no GPU"),
        ((2, nodes((4, 0)), {"device": "tpu"}), "--ray-device 'tpu': use one of auto, cpu, gpu"),
    ],
)
def test_a_cluster_too_small_names_the_option(args, message):
    with pytest.raises(RayBackendError, match=message):
        plan(*args[:2], **(args[2] if len(args) > 2 else {}))
    with pytest.raises(RayBackendError, match="--replicas 2: "):
        plan(2, nodes((4, 0)), cpus_per_replica=2)  # 2 × 2 CPUs and none for Ray Data
    with pytest.raises(RayBackendError, match="--ray-device 'tpu': use one of auto, cpu, gpu"):
        RayBackend("/models/m", device="tpu")


def test_only_qmc_and_named_vllm_variables_reach_the_replicas():
    import vllm.envs

    environ = {
        "QMC_SAMPLER": "lattice", "QMC_SAMPLER_GROUP_TTL": "30", "QMC_EVAL_API_KEY": "secret",
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_HOST_IP": "10.0.0.5", "VLLM_PORT": "8100", "VLLM_CACHE_ROOT": "/home/me/.cache/vllm",
        "PATH": "/usr/bin", "HOME": "/home/me",
    }  # fmt: skip
    env, kept = replica_env(environ)
    assert env == {"QMC_SAMPLER": "lattice", "QMC_SAMPLER_GROUP_TTL": "30", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
    assert kept == ["QMC_EVAL_API_KEY", "VLLM_CACHE_ROOT", "VLLM_HOST_IP", "VLLM_PORT"]  # named on the start line
    assert FORWARDED_VLLM_ENV <= set(vllm.envs.environment_variables)  # every name one vLLM reads


def test_a_local_model_folder_is_passed_as_an_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "models" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert RayBackend("models/m").model == str(tmp_path / "models" / "m")
    assert RayBackend("./models/../models/m").model == str(tmp_path / "models" / "m")
    assert RayBackend("org/hub-model").model == "org/hub-model"  # not a folder here: a hub id, left to vLLM
    assert RayBackend(None).model is None


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


def test_every_row_is_one_explicit_member_with_the_same_keys_and_prompts_are_stored_once(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 4, "stop": []}
    jobs = [
        GroupJob(("lattice", 0, 0), [{"role": "user", "content": "hi"}], None, 4, 11, "lattice", "id", sampling),
        GroupJob(("iid", "p", 1), None, "the quick brown", 2, 12, "iid", "id", sampling),
    ]
    table = MemberTable.build(jobs, tokenizer)
    rows = [table.row(serial) for serial in range(table.rows)]
    assert [(r["qmc_job"], r["qmc_member"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert len({tuple(sorted(r["sampling_params"]["extra_args"])) for r in rows}) == 1  # Arrow merges the structs
    assert all(v is not None for r in rows for v in r["sampling_params"]["extra_args"].values())
    last = rows[-1]["sampling_params"]
    assert last["n"] == 1 and last["include_stop_str_in_output"] and last["max_tokens"] == 4
    assert last["extra_args"] == {"qmc_method": "iid", "qmc_seed": 12, "qmc_order": "id",
                                  "qmc_group": "qmc-eval:iid:p:1", "qmc_index": 1, "qmc_n": 2}  # fmt: skip
    assert rows[0]["tokenized_prompt"] == prompt_token_ids(tokenizer, jobs[0])
    assert rows[-1]["tokenized_prompt"] == prompt_token_ids(tokenizer, jobs[1])
    # Another sampler's group of the same prompt: its tokens are not stored again.
    again = GroupJob(("sobol", 0, 0), jobs[0].messages, None, 8, 13, "sobol", "id", sampling)
    both = MemberTable.build([*jobs, again], tokenizer)
    assert both.rows == 14 and len(both.tokens) == len(table.tokens) and both.prompt_of.tolist() == [0, 1, 0]
    assert both.row(13)["tokenized_prompt"] == rows[0]["tokenized_prompt"]
    assert both.row(13)["sampling_params"]["extra_args"]["qmc_index"] == 7


def test_cpu_replicas_get_bundles_and_threads_gpu_replicas_the_stages_defaults(monkeypatch):
    pytest.importorskip("ray.data.llm", reason="ray extra not installed")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the driver's engine settings reach the replicas...
    monkeypatch.setenv("VLLM_HOST_IP", "10.0.0.5")  # ...its host's address does not
    cpu = RayBackend("/models/m", replicas=2)
    cpu.plan, cpu._dtype_why = ReplicaPlan("cpu", 2, 3), ("float32", "")
    config = cpu.processor_config()
    assert config.concurrency == (2, 2) and config.log_engine_metrics is False
    assert [b["CPU"] for b in config.placement_group_config["bundles"]] == [3]  # (validated: GPU 0 added)
    env = config.runtime_env["env_vars"]
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "VLLM_HOST_IP" not in env
    assert config.engine_kwargs["enforce_eager"] and config.engine_kwargs["dtype"] == "float32"
    gpu = RayBackend("/models/m", replicas=4)
    gpu.plan, gpu._dtype_why = ReplicaPlan("gpu", 4, 1), ("auto", "")
    config = gpu.processor_config()
    assert config.placement_group_config is None and "OMP_NUM_THREADS" not in config.runtime_env["env_vars"]
    assert "enforce_eager" not in config.engine_kwargs and config.concurrency == (4, 4)


@pytest.mark.parametrize("recipe", ["ray_recipe", "ray_serve_recipe"])
def test_the_docs_recipes_write_out_the_backends_cpu_replica_on_one_cpu(monkeypatch, tmp_path, recipe):
    # The recipes spell the settings out (a user reads and copies them whole): they must stay cpu_replica(1)'s.
    pytest.importorskip("ray.data.llm", reason="ray extra not installed")
    import importlib

    import ray

    from qmc_sampler.cpu_defaults import engine_dtype

    module = importlib.import_module(f"qmc_sampler.eval.backends.{recipe}")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})  # a cluster without GPUs
    config = module.stage_config("/models/m", 2, 4, {}) if recipe == "ray_recipe" else module.llm_config("/models/m", 2)
    replica = cpu_replica(1)
    bundles = config.placement_group_config["bundles"]
    assert [b["CPU"] for b in bundles] == [b["CPU"] for b in replica.placement_group_config["bundles"]]
    assert config.runtime_env["env_vars"].items() >= replica.env_vars.items()
    assert config.engine_kwargs.items() >= replica.engine_kwargs.items()
    # qmc-sampler's CPU dtype, as the backend's: not vLLM's "auto", which runs a float32 checkpoint in bf16
    assert config.engine_kwargs["dtype"] == engine_dtype("auto", "cpu", "/models/m")[0]
    (tmp_path / "config.json").write_text('{"torch_dtype": "float32"}')
    on_float32 = module.stage_config(str(tmp_path), 2, 4, {}) if recipe == "ray_recipe" else module.llm_config(
        str(tmp_path), 2
    )
    assert on_float32.engine_kwargs["dtype"] == "float32"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ray", "--ray-device", "tpu"], "argument --ray-device: invalid choice: 'tpu'"),
        (["--ray-device", "cpu"], "--ray-device: give --ray too"),
        (["--ray", "--ray-device", "cpu", "--replicas", "0"], "argument --replicas: 0 must be >= 1"),
    ],
)
def test_a_bad_ray_device_is_one_line_and_exit_code_2_before_any_cluster(tmp_path, monkeypatch, capsys, argv, message):
    from qmc_sampler.eval.cli import main

    cache = tmp_path / "model-cache"  # as on a new machine: the default model not converted yet
    monkeypatch.setenv("QMC_SAMPLER_CACHE", str(cache))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--quiet", "--task", "basic_arithmetic", "--n", "4", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not cache.exists() and not (tmp_path / "o").exists()  # no model, no output folder, no cluster
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


def test_the_recipes_common_arguments():
    args = recipe_parser(replicas=2).parse_args(["MODEL_DIR"])
    assert (args.model, args.address, args.replicas) == ("MODEL_DIR", None, 2)
    args = recipe_parser(replicas=1).parse_args(["m", "--address", "auto", "--replicas", "3"])
    assert (args.address, args.replicas) == ("auto", 3)
