"""The package's layers, read off its imports: the core (``qmc_sampler``, ``qmc_sampler.members``)
imports no door and no vLLM; ``qmc_sampler.vllm_engine`` (vLLM's touch points, the start-up check)
imports no door; and no door — the vLLM plugin, qmc-serve, qmc-eval, the transformers path —
imports another: what two doors share lives in the core or in ``vllm_engine``."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOORS = ("vllm_plugin", "server", "eval", "hf")
SHARED = ("vllm_engine",)


def imported(path: Path) -> set[str]:
    """The absolute module names a Python file imports, anywhere in it (a function's lazy import
    too): ``import a.b``, ``from a.b import c`` (as ``a.b`` and ``a.b.c``, since ``c`` may be a
    module) and ``importlib.import_module("a.b")`` with a literal name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def part_of(name: str) -> str | None:
    """Which top-level part of the package a module name belongs to (a door, ``vllm_engine``,
    ``core``), or None for a module of another distribution."""
    pieces = name.split(".")
    if pieces[0] != "qmc_sampler":
        return None
    return pieces[1] if len(pieces) > 1 and pieces[1] in (*DOORS, *SHARED) else "core"


def imports_of(folder: str) -> dict[str, set[str]]:
    """Each Python file of ``folder`` (relative to the repository) → the modules it imports."""
    return {str(p.relative_to(ROOT)): imported(p) for p in sorted((ROOT / folder).rglob("*.py"))}


def crossings(folder: str, allowed: set[str | None], also_forbidden: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Imports of ``folder`` into parts of the package outside ``allowed`` (or into ``also_forbidden``
    distributions), by file."""
    found = {}
    for path, names in imports_of(folder).items():
        bad = sorted(n for n in names if part_of(n) not in allowed or n.split(".")[0] in also_forbidden)
        if bad:
            found[path] = bad
    return found


def test_the_import_reader_sees_lazy_absolute_and_dynamic_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os.path\nfrom qmc_sampler.members import keys\n"
        "def f():\n    from qmc_sampler.vllm_plugin.hooks import register\n"
        "    import importlib\n    return importlib.import_module('qmc_sampler.server.main')\n"
        "from . import sibling\n"
    )
    assert imported(source) == {
        "os.path", "qmc_sampler.members", "qmc_sampler.members.keys", "qmc_sampler.vllm_plugin.hooks",
        "qmc_sampler.vllm_plugin.hooks.register", "importlib", "qmc_sampler.server.main",
    }  # fmt: skip
    assert [part_of(n) for n in ("qmc_sampler", "qmc_sampler.members.keys", "qmc_sampler.hf", "vllm")] == [
        "core", "core", "hf", None,
    ]  # fmt: skip


@pytest.mark.parametrize("door", DOORS)
def test_a_door_imports_the_core_and_vllm_engine_never_another_door(door):
    assert not crossings(door, {None, "core", *SHARED, door})


def test_vllm_engine_imports_no_door():
    assert not crossings("vllm_engine", {None, "core", "vllm_engine"})


def test_the_core_imports_no_door_and_no_vllm():
    assert not crossings("qmc_sampler", {None, "core"}, also_forbidden=("vllm",))


def test_every_folder_of_the_namespace_is_a_door_the_core_or_shared():
    tree = ast.parse((ROOT / "setup.py").read_text())
    (subpackages,) = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                      and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["SUBPACKAGES"]]  # fmt: skip
    assert set(subpackages) == {*DOORS, *SHARED}  # a new folder is placed in one layer here
