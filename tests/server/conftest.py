"""qmc-serve's tests run where qmc-serve runs: on a vLLM it refuses to start on (0.24-0.28, whose AsyncLLM
cannot count its unfinished requests), its modules are not collected, and the run's summary says so."""

import importlib.util

_WHY: list[str] = []


def _qmc_serve_refused() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return None  # each module skips on its own without vLLM
    from qmc_sampler.vllm_engine import compat

    try:
        compat.locate("async_unfinished")
    except compat.TouchpointError as e:
        return str(e)
    return None


def pytest_ignore_collect(collection_path, config):
    if collection_path.name.startswith("test_") and collection_path.suffix == ".py":
        if not _WHY:
            _WHY.append(_qmc_serve_refused() or "")
        return bool(_WHY[0]) or None
    return None


def pytest_terminal_summary(terminalreporter):
    if _WHY and _WHY[0]:
        terminalreporter.write_line(f"tests/server not collected: qmc-serve refuses this vLLM ({_WHY[0]})")
