"""Where a Ray run's replicas go and what they get: placement on the cluster's free resources,
a CPU replica's settings, the driver's variables they are passed (no Ray imported here).

How :class:`~qmc_sampler.eval.backends.ray_backend.RayBackend` uses them: its module docstring.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "DEVICES",
    "FORWARDED_VLLM_ENV",
    "SPARE_CPUS",
    "CpuReplica",
    "RayBackendError",
    "ReplicaPlan",
    "cpu_replica",
    "plan_replicas",
    "recipe_parser",
    "replica_env",
]

#: ``--ray-device``: where the replicas run (``auto``: on GPUs where the cluster has any, else on CPUs).
DEVICES = ("auto", "cpu", "gpu")
#: Logical CPUs a local cluster gets beyond the replicas' own, for Ray Data's other tasks (in the Ray Serve
#: recipe: Serve's own actors).
SPARE_CPUS = 2
#: The driver's ``VLLM_*`` variables the replicas get: settings of the engine, the same on every node.
#: Host-specific ones (``VLLM_HOST_IP``, ``VLLM_PORT``, ``VLLM_CACHE_ROOT``, ``VLLM_DP_*``, …) are not passed.
FORWARDED_VLLM_ENV = frozenset({
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
    "VLLM_BATCH_INVARIANT",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_CPU_ATTN_SPLIT_KV",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_DISABLE_COMPILE_CACHE",
    "VLLM_DO_NOT_TRACK",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_ENGINE_READY_TIMEOUT_S",
    "VLLM_FLOAT32_MATMUL_PRECISION",
    "VLLM_LOGGING_LEVEL",
    "VLLM_NO_USAGE_STATS",
    "VLLM_PLUGINS",
    "VLLM_USE_MODELSCOPE",
    "VLLM_WORKER_MULTIPROC_METHOD",
})  # fmt: skip


class RayBackendError(RuntimeError):
    """A Ray run that cannot start or finish as asked; the message is one line (options named)."""


@dataclass(frozen=True)
class ReplicaPlan:
    """Where the replicas run: ``device`` ``cpu`` or ``gpu``, and the CPUs (OpenMP threads) of each CPU replica."""

    device: str
    replicas: int
    cpus_per_replica: int


def plan_replicas(
    replicas: int,
    free: Sequence[Mapping[str, float]],
    total: Mapping[str, float],
    *,
    local: bool,
    device: str = "auto",
    cpus_per_replica: int | None = None,
) -> ReplicaPlan:
    """How to place ``replicas`` engines on the resources of the cluster that are free now.

    Args:
        replicas: vLLM engines to start.
        free: each live node's free resources (``{"CPU": …, "GPU": …}``; Ray's ``available_resources_per_node``).
        total: the cluster's resources in all (``ray.cluster_resources()``): ``auto`` means GPUs where it has any.
        local: a local cluster was started for them (its CPUs are the replicas' plus :data:`SPARE_CPUS`).
        device: ``auto``, ``cpu`` or ``gpu`` (:data:`DEVICES`).
        cpus_per_replica: the CPUs of each CPU replica (default: an equal share of the free CPUs, at most
            one node's, leaving :data:`SPARE_CPUS` (at least one) to Ray Data).

    Returns:
        The plan: one whole free GPU per GPU replica; CPU bundles that fit on the nodes' free CPUs.

    Raises:
        RayBackendError: a device not in :data:`DEVICES`, or too few free resources (the message names
            ``--replicas`` or ``--ray-device``, and says when the rest of the cluster is busy).
    """
    if device not in DEVICES:
        raise RayBackendError(f"--ray-device {device!r}: use one of {', '.join(DEVICES)}")
    has_gpus = total.get("GPU", 0) >= 1
    if device == "gpu" and not has_gpus:
        raise RayBackendError("--ray-device gpu: the Ray cluster has no GPU (--ray-device cpu: CPU replicas)")
    if device == "gpu" or (device == "auto" and has_gpus):
        gpus = sum(int(node.get("GPU", 0)) for node in free)  # a replica's GPU is on one node, whole
        if replicas > gpus:
            hint = "" if device == "gpu" else "; --ray-device cpu: CPU replicas"
            raise RayBackendError(
                f"--replicas {replicas}: the Ray cluster has {gpus:g} GPUs{_busy(gpus, total.get('GPU', 0))}; "
                f"each replica needs one{hint}"
            )
        return ReplicaPlan("gpu", replicas, 1)
    cpus_free = sum(node.get("CPU", 0) for node in free)
    largest = max((node.get("CPU", 0) for node in free), default=0)
    spare = SPARE_CPUS if local else min(SPARE_CPUS, max(1, int(cpus_free) - replicas))
    cpus = cpus_per_replica or min(int(largest), int(cpus_free - spare) // replicas)
    fixed = cpus_per_replica is not None
    # Each bundle on one node: fewer CPUs each until the replicas fit on the nodes (one CPU left to Ray Data).
    while cpus >= 1 and not (_bundles(free, cpus) >= replicas and replicas * cpus + 1 <= cpus_free):
        cpus = 0 if fixed else cpus - 1
    if cpus < 1:
        gpu = "" if has_gpus else " and no GPU"
        raise RayBackendError(
            f"--replicas {replicas}: the Ray cluster has {cpus_free:g} CPUs{_busy(cpus_free, total.get('CPU', 0))}"
            f"{gpu}; {replicas} CPU replicas need {replicas * (cpus_per_replica or 1) + 1} (one each, and one for "
            "Ray Data's own tasks)"
        )
    return ReplicaPlan("cpu", replicas, cpus)


def _bundles(free: Sequence[Mapping[str, float]], cpus: int) -> int:
    """How many bundles of ``cpus`` CPUs the nodes' free CPUs hold (a bundle is never split over nodes)."""
    return sum(int(node.get("CPU", 0) // cpus) for node in free)


def _busy(free: float, total: float) -> str:
    """`` free (T in all)`` where other work holds part of the cluster: the cause of a refusal, said."""
    return f" free ({total:g} in all)" if free < total else ""


def replica_env(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The driver's variables the replicas get, and the ``VLLM_*``/``QMC_*`` ones kept back (names only).

    Passed: every ``QMC_*`` variable but keys (``*_API_KEY``: secrets no replica reads) and the ``VLLM_*``
    ones of :data:`FORWARDED_VLLM_ENV`. Kept back: the other ``VLLM_*`` (host-specific, e.g. ``VLLM_HOST_IP``).
    """
    env, kept = {}, []
    for key, value in environ.items():
        if (key.startswith("QMC_") and not key.endswith("_API_KEY")) or key in FORWARDED_VLLM_ENV:
            env[key] = value
        elif key.startswith(("QMC_", "VLLM_")):
            kept.append(key)
    return env, sorted(kept)


class CpuReplica(NamedTuple):
    """A vLLM replica's settings on CPUs without a GPU, as Ray's LLM configs take them (:func:`cpu_replica`)."""

    placement_group_config: dict[str, Any]
    env_vars: dict[str, str]
    engine_kwargs: dict[str, Any]


def cpu_replica(cpus: int) -> CpuReplica:
    """What a vLLM replica on ``cpus`` CPUs and no GPU needs from Ray: a placement bundle of the CPUs,
    as many OpenMP threads, unbound (engines on one machine would otherwise bind their threads to the
    same cores), and eager mode.

    The docs' recipes (``eval/backends/ray_recipe.py``, ``eval/backends/ray_serve_recipe.py``) write these settings out
    for one CPU, so that each reads, and is copied, whole; ``tests/eval/backends/test_ray_plan.py`` checks that
    they agree with this.
    """
    return CpuReplica(
        placement_group_config={"bundles": [{"CPU": cpus}]},
        env_vars={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(cpus)},
        engine_kwargs={"enforce_eager": True},
    )


def recipe_parser(replicas: int) -> argparse.ArgumentParser:
    """The arguments both Ray recipes take: ``MODEL``, ``--address`` (an existing cluster; none: start
    a local one with ``replicas`` + :data:`SPARE_CPUS` logical CPUs) and ``--replicas`` (default
    ``replicas``). Each recipe adds its own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--address", default=None)
    parser.add_argument("--replicas", type=int, default=replicas)
    return parser
