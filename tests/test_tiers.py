"""The suite's two tiers (tests/conftest.py): ``make test`` runs the fast one, ``make test-slow`` the
slow one, ``.ci/run`` both — every test module in exactly one of them."""

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def conftest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_every_module_the_tiers_and_the_order_name_exists(conftest):
    named = [*conftest.SLOW_TIER, *conftest.COSTLIEST_FIRST]
    assert [name for name in named if not (TESTS / name).is_file()] == []


class Config:
    """What ``pytest_ignore_collect`` reads of pytest's config: the ``--tier`` option."""

    def __init__(self, tier: str):
        self.tier = tier

    def getoption(self, name: str) -> str:
        assert name == "--tier"
        return self.tier


def test_the_fast_and_slow_tiers_part_the_modules_between_them(conftest):
    modules = sorted(TESTS.rglob("test_*.py"))
    kept = {tier: {p.relative_to(TESTS).as_posix() for p in modules
                   if not conftest.pytest_ignore_collect(p, Config(tier))} for tier in conftest.TIERS}  # fmt: skip
    assert kept["slow"] == set(conftest.SLOW_TIER)
    assert kept["fast"] == kept["all"] - kept["slow"] and len(kept["all"]) == len(modules)
    # Folders and helper modules are never left out: a tier chooses among test modules only.
    assert not conftest.pytest_ignore_collect(TESTS / "eval", Config("slow"))
    assert not conftest.pytest_ignore_collect(TESTS / "tiny_model.py", Config("slow"))
