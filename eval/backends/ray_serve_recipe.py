"""Ray Serve LLM with qmc-sampler's drop-in: the docs' recipe, run as it is by the tests.

    python -m qmc_sampler.eval.backends.ray_serve_recipe MODEL_DIR [--address ADDRESS] [--replicas 1] [--port 8000]

Serves MODEL_DIR as ``model`` at ``http://127.0.0.1:PORT/v1`` (OpenAI API) until stopped. Ray
Serve LLM runs vLLM's ``AsyncLLM`` in each replica, so the installed plugin loads there;
``QMC_SAMPLER=lattice`` in the replicas' environment makes every ``n > 1`` request (and every
prompt repeated as ``n = 1`` requests) one correlated group, and ``vllm_xargs`` take the
per-request arguments (``qmc_method``, ``qmc_seed``, …).
"""

import signal

import ray
from qmc_sampler.eval.backends.ray_plan import SPARE_CPUS, recipe_parser
from ray import serve
from ray.serve.llm import LLMConfig, build_openai_app

from qmc_sampler.cpu_defaults import engine_dtype


def llm_config(model: str, replicas: int) -> LLMConfig:
    """The drop-in in the replicas' environment; CPU replicas without GPUs, the defaults with them."""
    env = {"QMC_SAMPLER": "lattice"}
    cpu, engine = {}, {}
    if not ray.cluster_resources().get("GPU"):
        cpu = {"accelerator_config": {"kind": "cpu"}, "placement_group_config": {"bundles": [{"CPU": 1}]}}
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        # vLLM's "auto" runs a float32 checkpoint in bf16 on CPUs with bf16; qmc-sampler's CPU default keeps it
        engine = {"enforce_eager": True, "dtype": engine_dtype("auto", "cpu", model)[0]}
    return LLMConfig(
        model_loading_config={"model_id": "model", "model_source": model},
        deployment_config={"autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas}},
        engine_kwargs=engine,
        log_engine_metrics=False,  # vLLM's Ray metrics wrapper fails on vllm-cpu
        runtime_env={"env_vars": env},
        **cpu,
    )


def main() -> None:
    """Start the app and serve until interrupted (Ctrl-C or SIGTERM), then take it down."""
    p = recipe_parser(replicas=1)
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:  # a local cluster: logical CPUs for the replicas and for Serve's own actors
        ray.init(num_cpus=args.replicas + SPARE_CPUS)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as on Ctrl-C
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    try:
        serve.run(build_openai_app({"llm_configs": [llm_config(args.model, args.replicas)]}), blocking=True)
    finally:
        serve.shutdown()


if __name__ == "__main__":
    main()
