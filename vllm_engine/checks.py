"""Start-up checks: does this engine really run the plugin, and does its draw work?

A result labelled ``lattice`` from an engine that never loaded the processor, or whose draw fails
at every step, would silently be i.i.d. sampling. Before a server or an evaluation run uses an
engine, :func:`require_plugin` (``vllm.LLM``) / :func:`require_plugin_async` (``AsyncLLM``) check,
and fail with one line otherwise:

* the front-end: a request with an invalid ``qmc_method`` must be refused at
  admission (the processor's ``validate_params``);
* every worker: ``collective_rpc("qmc_sampler_stats")`` (added by
  :mod:`qmc_sampler.vllm_plugin.hooks`) must find a processor instance, active; and
* every engine draws one real designed token: its workers' ``drawn`` count moves, and no row of it
  is left to vLLM because the draw failed (``draw_failed_rows``).

Failed draws, told across processes (the second half of this module): a worker knows when its draw
fails, but the processes that admit requests and label their replies — vLLM's front end, qmc-serve's
middleware, qmc-eval — are other processes, and vLLM has no channel from a logits processor to
them. So a worker records its failures in a folder of this machine that only its user can write
(:func:`record_failed_draw`, :func:`record_broken_draws`), and those processes read it
(:func:`draws_failed_since`, :func:`broken_worker`, :func:`broken_below`): a stat per call, the
folder read again only when it changed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "PROBE_METHOD",
    "broken_below",
    "broken_worker",
    "draws_failed_since",
    "engine_stats_async",
    "record_broken_draws",
    "record_failed_draw",
    "require_plugin",
    "require_plugin_async",
]

logger = logging.getLogger("vllm.qmc_sampler")

PROBE_METHOD = "-qmc-sampler-probe-"
_HOW = (
    "install qmc-llm-sampler in the engine's environment (its entry points load the processor), or pass "
    "logits_processors=['qmc_sampler.vllm_plugin:QMCLogitsProcessor']"
)
#: The utility call that asks one engine core for its workers' plugin stats.
_STATS_CALL = ("collective_rpc", "qmc_sampler_stats", None, (), None)


def _probe_params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, extra_args={"qmc_method": PROBE_METHOD})


def _drawn_params() -> Any:
    """One designed token, in a group of its own (no auto group a user's request could join)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=1.0, extra_args={"qmc_method": "lattice", "qmc_auto_group": 0})


def _front_end_refused(error: Exception | None) -> None:
    if error is None:
        raise RuntimeError(f"this vLLM engine does not run the qmc-sampler logits processor: {_HOW}")
    if PROBE_METHOD not in str(error):  # refused for another reason: the plugin is there but cannot act
        raise RuntimeError(f"this vLLM engine refuses designs: {error}")


def _check_workers(stats: list[dict[str, Any]]) -> None:
    missing = [i for i, s in enumerate(stats) if not s.get("processors")]
    if missing:
        raise RuntimeError(f"vLLM worker(s) {missing} do not run the qmc-sampler logits processor: {_HOW}")
    inactive = {i: s["inactive"] for i, s in enumerate(stats) if s.get("inactive")}
    if inactive:
        raise RuntimeError(
            f"the qmc-sampler logits processor is inactive in vLLM worker(s) {sorted(inactive)} "
            f"({next(iter(inactive.values()))}): use a vLLM release of qmc-sampler's tested range"
        )
    broken = {i: s["draw_broken"] for i, s in enumerate(stats) if s.get("draw_broken")}
    if broken:
        raise RuntimeError(
            f"the qmc-sampler plugin stopped drawing in vLLM worker(s) {sorted(broken)} "
            f"({next(iter(broken.values()))}); restart the engine (its log holds the draw's traceback)"
        )


def _check_draws(before: list[list[dict[str, Any]]], after: list[list[dict[str, Any]]]) -> None:
    """Each engine drew the designed token it was sent: its ``drawn`` moved, and no row was left to
    vLLM because the draw failed."""

    def total(workers: list[dict[str, Any]], key: str) -> int:
        return sum(int(w.get(key) or 0) for w in workers)

    pairs = list(enumerate(zip(before, after, strict=True)))
    failed = [
        e
        for e, (b, a) in pairs
        if total(a, "draw_failed_rows") > total(b, "draw_failed_rows") or any(w.get("draw_broken") for w in a)
    ]
    if failed:
        error = next((w.get("draw_error") for w in after[failed[0]] if w.get("draw_error")), None)
        raise RuntimeError(
            f"the qmc-sampler plugin's draw fails in vLLM engine(s) {failed} ({error}): designed requests "
            "would be sampled by vLLM itself; the engine's log holds the traceback"
        )
    undrawn = [e for e, (b, a) in pairs if total(a, "drawn") <= total(b, "drawn")]
    if undrawn:
        raise RuntimeError(f"vLLM engine(s) {undrawn} served a designed request without the qmc-sampler plugin "
                           f"drawing it: {_HOW}")  # fmt: skip


def _rpc_failed(error: Exception) -> RuntimeError:
    return RuntimeError(
        f"cannot ask the vLLM workers whether they run qmc-sampler ({type(error).__name__}: {error}); "
        "if VLLM_PLUGINS is set, include 'qmc_sampler' in it"
    )


def require_plugin(llm: Any) -> dict[str, Any]:
    """Check a ``vllm.LLM`` runs the processor in its front-end and workers, and draws with it.

    Returns:
        The first worker's :func:`~qmc_sampler.vllm_plugin.processor.plugin_stats`, after its designed token.

    Raises:
        RuntimeError: one line saying which half is missing, or that the draw fails, and what to do.
    """

    async def probe() -> None:
        llm.generate([{"prompt_token_ids": [0]}], _probe_params(), use_tqdm=False)

    async def workers() -> list[list[dict[str, Any]]]:
        return [llm.collective_rpc("qmc_sampler_stats")]  # one engine

    async def draw(engine: int) -> None:
        llm.generate([{"prompt_token_ids": [0]}], _drawn_params(), use_tqdm=False)

    # Its awaits are of these synchronous calls, so it never suspends: one step runs it to the end,
    # in this thread, without an event loop.
    check = _require(probe, workers, draw)
    try:
        check.send(None)
    except StopIteration as done:
        return done.value
    check.close()
    raise AssertionError("the plugin check suspended")


async def engine_stats_async(engine: Any) -> list[dict[str, Any]]:
    """Every worker's plugin stats, across all data-parallel engines of an ``AsyncLLM``.

    Returns:
        The workers' :func:`~qmc_sampler.vllm_plugin.processor.plugin_stats`, engine by engine.

    Raises:
        RuntimeError: the engine client has several engines and no way to ask each of them.
    """
    return [worker for workers in await _stats_by_engine(engine) for worker in workers]


async def _stats_by_engine(engine: Any) -> list[list[dict[str, Any]]]:
    """:func:`engine_stats_async`, one list of workers per data-parallel engine.

    ``AsyncLLM.collective_rpc`` answers for the first engine only when there are several. vLLM
    >= 0.32's data-parallel client asks each one with ``call_utility_all_async``; on older releases
    (0.24–0.31 have ``AsyncMPClient._call_utility_async(..., engine=)``, on which that method is
    built) the same utility call is sent to each engine here.
    """
    core = getattr(engine, "engine_core", None)
    engines = list(getattr(core, "core_engines", None) or ())
    if len(engines) > 1:
        if hasattr(core, "call_utility_all_async"):
            return list(await core.call_utility_all_async(*_STATS_CALL))
        ask = getattr(core, "_call_utility_async", None)
        if ask is None:
            raise RuntimeError(
                f"this vLLM's engine client ({type(core).__name__}) cannot ask each of its {len(engines)} "
                "data-parallel engines for the plugin's stats; serve without --data-parallel-size, or use a "
                "vLLM release of qmc-sampler's tested range"
            )
        return list(await asyncio.gather(*(ask(*_STATS_CALL, engine=one) for one in engines)))
    return [await engine.collective_rpc("qmc_sampler_stats")]


async def require_plugin_async(engine: Any) -> dict[str, Any]:
    """:func:`require_plugin` for an ``AsyncLLM`` (the server's engine), every data-parallel engine included."""

    async def probe() -> None:
        async for _ in engine.generate({"prompt_token_ids": [0]}, _probe_params(), "qmc-sampler-probe"):
            pass

    async def draw(rank: int) -> None:
        several = len(getattr(engine.engine_core, "core_engines", None) or ()) > 1
        pinned = {"data_parallel_rank": rank} if several else {}
        request_id = f"qmc-sampler-check-{rank}-{uuid.uuid4().hex[:8]}"
        async for _ in engine.generate({"prompt_token_ids": [0]}, _drawn_params(), request_id, **pinned):
            pass

    return await _require(probe, lambda: _stats_by_engine(engine), draw)


async def _require(
    probe: Callable[[], Awaitable[Any]],
    workers: Callable[[], Awaitable[list[list[dict[str, Any]]]]],
    draw: Callable[[int], Awaitable[Any]],
) -> dict[str, Any]:
    """The check, written once for both engines: ``probe`` sends the request the front-end must
    refuse, ``workers`` asks every worker for its stats (engine by engine), ``draw(engine)`` sends one
    designed token to that engine."""
    error = None
    try:
        await probe()
    except Exception as e:  # vLLM wraps validate_params' ValueError (VLLMValidationError)
        error = e
    _front_end_refused(error)
    stats = await _ask(workers)
    _check_workers([worker for workers in stats for worker in workers])
    try:
        for engine in range(len(stats)):
            await draw(engine)
    except ValueError as e:
        # Admission refuses designs in this engine for a processed logprobs mode it cannot keep correct:
        # every designed request is refused alike, so nothing will be drawn, or served under a design's name.
        # Any other refusal of the drawn request is the check's failure.
        if "cannot keep correct for designed requests" not in str(e):
            raise RuntimeError(f"this vLLM engine refused the start-up check's designed request: {e}") from None
        return stats[0][0]
    after = await _ask(workers)
    _check_draws(stats, after)
    return after[0][0]


async def _ask(workers: Callable[[], Awaitable[list[list[dict[str, Any]]]]]) -> list[list[dict[str, Any]]]:
    try:
        return await workers()
    except Exception as e:
        raise _rpc_failed(e) from None


# ---- failed draws, told to the processes that admit and label requests (module docstring) ----------

_FAILED, _BROKEN = "failed-", "broken-"
_said_folder: list[str] = []


def _folder(create: bool = False) -> Path | None:
    """This user's folder of draw records, or None (not there; or not this user's own: then said once)."""
    path = Path(tempfile.gettempdir()) / f"qmc-sampler-draws-{os.getuid()}"
    try:
        if create:
            path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError:
        return None
    # (lstat: a link is not a folder; a folder others may write to is not a private record)
    if info.st_uid != os.getuid() or not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o077:
        if not _said_folder:
            _said_folder.append(str(path))
            logger.error("qmc-sampler: %s is not this user's own folder; failed draws are not told to other "
                         "processes through it", path)  # fmt: skip
        return None
    return path


def record_failed_draw() -> None:
    """Worker: this step's designed rows were left to vLLM because the draw failed (the mtime of
    ``failed-<pid>`` is the last such step). Never raises."""
    folder = _folder(create=True)
    if folder is None:
        return
    path = folder / f"{_FAILED}{os.getpid()}"
    try:
        if not path.exists():  # this process's first: the records of processes gone are removed
            _tidy(folder)
        path.touch()
    except OSError as e:
        logger.warning("qmc-sampler: cannot record a failed draw in %s (%s)", folder, e)


def _tidy(folder: Path) -> None:
    """Remove the records of processes that are gone."""
    for path in [*folder.glob(f"{_FAILED}*"), *folder.glob(f"{_BROKEN}*")]:
        pid = path.name.split("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                path.unlink()
            except OSError:
                pass


def record_broken_draws(reason: str) -> Callable[[], None]:
    """Worker: this process stopped drawing (``reason``); admission in the processes above it and in
    those that know its pid refuses designs from now on.

    Returns:
        What removes the record (call it when the processor goes away). Never raises.
    """
    folder = _folder(create=True)
    if folder is None:
        return lambda: None
    path = folder / f"{_BROKEN}{os.getpid()}"
    record = {"reason": reason[:_REASON_CHARS], "above": _ancestors()}
    try:
        part = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        part.write_text(json.dumps(record))
        os.replace(part, path)  # readers see all of it or none
    except OSError as e:
        logger.warning("qmc-sampler: cannot record in %s that this worker stopped drawing (%s)", folder, e)

    def remove() -> None:
        try:
            path.unlink()
        except OSError:
            pass

    return remove


def draws_failed_since(pids: Iterable[int], since_ns: int) -> bool:
    """Whether a worker among ``pids`` left a designed row to vLLM because its draw failed at or after
    ``since_ns`` (``time.time_ns()``, this machine's clock). Workers on other machines are not seen."""
    folder = _folder()
    if folder is None:
        return False
    for pid in pids:
        try:
            if (folder / f"{_FAILED}{pid}").stat().st_mtime_ns >= since_ns:
                return True
        except OSError:
            continue
    return False


def broken_worker(pids: Iterable[int]) -> str | None:
    """Why a worker among ``pids`` stopped drawing, or None (qmc-serve and qmc-eval know their workers)."""
    wanted = set(pids)
    for pid, record in _broken_records().items():
        if pid in wanted:
            return f"worker pid {pid}: {record['reason']}"
    return None


def broken_below() -> str | None:
    """Why a worker of an engine this process started (this process, or one below it) stopped drawing,
    or None: what vLLM's front end asks at admission (it knows no worker's pid)."""
    me = os.getpid()
    for pid, record in _broken_records().items():
        if pid == me or me in record.get("above", ()):
            return f"worker pid {pid}: {record['reason']}"
    return None


_cache: dict[str, Any] = {"mtime": None, "read_at": 0, "records": {}}
#: A reason as records, 400s and /stats carry it (the log holds the whole error).
_REASON_CHARS = 240
#: A folder's mtime moves in the kernel's clock ticks: changes within one tick of a read may not move
#: it again, so a read that close to the last change is not trusted for later calls (nanoseconds).
_RACY_NS = 1_000_000_000


def _broken_records() -> dict[int, dict[str, Any]]:
    """The broken-worker records of live processes (read again only when the folder changed)."""
    folder = _folder()
    if folder is None:
        return {}
    try:
        mtime = folder.stat().st_mtime_ns
    except OSError:
        return {}
    if mtime != _cache["mtime"] or _cache["read_at"] - mtime < _RACY_NS:
        read_at = time.time_ns()
        records: dict[int, dict[str, Any]] = {}
        for path in folder.glob(f"{_BROKEN}*"):
            try:
                pid, record = int(path.name[len(_BROKEN) :]), json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            # Another release's or a damaged record: never an error in every admission that reads it.
            if 0 < pid < 2**22 and isinstance(record, dict) and isinstance(record.get("reason"), str):
                records[pid] = {"reason": record["reason"][:_REASON_CHARS],
                                "above": [a for a in record.get("above") or () if isinstance(a, int)]}
        _cache.update(mtime=mtime, read_at=read_at, records=records)
    return {pid: r for pid, r in _cache["records"].items() if _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ancestors() -> list[int]:
    """This process's ancestors' pids, nearest first (Linux: /proc; elsewhere the parent only)."""
    found, pid = [], os.getpid()
    for _ in range(64):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        except (OSError, StopIteration, ValueError):
            return found or [os.getppid()]
        if pid < 1:
            break
        found.append(pid)  # pid 1 too: in a container the front end is often the entrypoint
        if pid == 1:
            break
    return found
