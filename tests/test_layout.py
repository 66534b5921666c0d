"""The package's layers, read off its imports: the core (``qmc_sampler``, ``qmc_sampler.members``)
imports no door, no ``vllm_engine`` and no vLLM; ``qmc_sampler.vllm_engine`` (vLLM's touch points,
the start-up check) imports no door; and no door — the vLLM plugin, qmc-serve, qmc-eval, the
transformers path — imports another: what two doors share lives in the core or in ``vllm_engine``.

Read are the import statements (absolute, relative, inside functions), ``__import__`` and
``importlib.import_module`` with literal names; a module name computed at run time, or handed to
vLLM as a string (``logits_processors=['qmc_sampler.vllm_plugin:…']``), is not an import here."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOORS = ("vllm_plugin", "server", "eval", "hf")
SHARED = ("vllm_engine",)


def imported(path: Path, package: str) -> set[str]:
    """The absolute names of the modules the Python file ``path`` imports, anywhere in it.

    Args:
        path: the file.
        package: the package the file belongs to once installed (``qmc_sampler.server`` for
            ``server/main.py``; the package itself for an ``__init__.py``), against which
            relative imports resolve.

    Returns:
        ``import a.b`` gives ``a.b``; ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (``c``
        may be a module); ``from ..x import y`` the same, resolved; ``__import__("a")`` and
        ``import_module("a")`` / ``import_module(".a", "pkg")`` with literal names give ``a`` /
        ``pkg.a``.
    """

    def resolve(name: str, level: int, anchor: str) -> str:
        if level == 0:
            return name
        base = anchor.split(".")[: len(anchor.split(".")) - (level - 1)]
        return ".".join([*base, name] if name else base)

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node.module or "", node.level, package)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
            "import_module",
            "__import__",
        ):
            literal = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None for a in node.args]
            if literal and literal[0]:
                name = literal[0]
                if name.startswith(".") and len(literal) > 1 and literal[1]:  # import_module(".x", "pkg")
                    stripped = name.lstrip(".")
                    name = resolve(stripped, len(name) - len(stripped), literal[1])
                names.add(name)
    return names


def part_of(name: str) -> str | None:
    """Which part of the package a module name belongs to (a door, ``vllm_engine``, ``core``),
    or None for a module of another distribution."""
    pieces = name.split(".")
    if pieces[0] != "qmc_sampler":
        return None
    return pieces[1] if len(pieces) > 1 and pieces[1] in (*DOORS, *SHARED) else "core"


def crossings(
    root: Path, package: str, folder: str, allowed: set[str | None], forbidden: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """The imports of the files of ``root/folder`` (installed as ``package``) into a part of the
    package outside ``allowed``, or into a distribution of ``forbidden``, by file."""
    found = {}
    for path in sorted((root / folder).rglob("*.py")):
        inner = path.relative_to(root / folder).parent.parts
        anchor = ".".join([package, *inner])
        names = imported(path, anchor)
        bad = sorted(n for n in names if part_of(n) not in allowed or n.split(".")[0] in forbidden)
        if bad:
            found[str(path.relative_to(root))] = bad
    return found


def test_the_import_reader_sees_every_form_of_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os.path\nfrom qmc_sampler.members import keys\n"
        "def f():\n    from qmc_sampler.vllm_plugin.hooks import register\n"
        "    import importlib\n    return importlib.import_module('qmc_sampler.server.main')\n"
        "from . import sibling\nfrom ..hf import rows\nfrom .. import eval\n"
        "__import__('qmc_sampler.vllm_engine')\nimport_module('.fields', 'qmc_sampler.server')\n"
    )
    assert imported(source, "qmc_sampler.server") == {
        "os.path", "qmc_sampler.members", "qmc_sampler.members.keys", "qmc_sampler.vllm_plugin.hooks",
        "qmc_sampler.vllm_plugin.hooks.register", "importlib", "qmc_sampler.server.main",
        "qmc_sampler.server", "qmc_sampler.server.sibling", "qmc_sampler.hf", "qmc_sampler.hf.rows",
        "qmc_sampler", "qmc_sampler.eval", "qmc_sampler.vllm_engine", "qmc_sampler.server.fields",
    }  # fmt: skip
    assert [part_of(n) for n in ("qmc_sampler", "qmc_sampler.members.keys", "qmc_sampler.hf", "vllm")] == [
        "core", "core", "hf", None,
    ]  # fmt: skip


def test_a_door_importing_another_is_found_in_a_tree_laid_out_as_the_package(tmp_path):
    (tmp_path / "server" / "sub").mkdir(parents=True)
    (tmp_path / "server" / "fine.py").write_text("from qmc_sampler.vllm_engine import compat\nfrom . import other\n")
    (tmp_path / "server" / "sub" / "deep.py").write_text("def f():\n    from ...vllm_plugin import hooks\n")
    assert crossings(tmp_path, "qmc_sampler.server", "server", {None, "core", *SHARED, "server"}) == {
        "server/sub/deep.py": ["qmc_sampler.vllm_plugin", "qmc_sampler.vllm_plugin.hooks"]
    }


@pytest.mark.parametrize("door", DOORS)
def test_a_door_may_import_the_core_and_vllm_engine_never_another_door(door, package_folders):
    package = f"qmc_sampler.{door}"
    assert not crossings(ROOT, package, package_folders[package], {None, "core", *SHARED, door})


def test_vllm_engine_imports_no_door(package_folders):
    package = "qmc_sampler.vllm_engine"
    assert not crossings(ROOT, package, package_folders[package], {None, "core", "vllm_engine"})


def test_the_core_imports_no_door_no_vllm_engine_and_no_vllm():
    assert not crossings(ROOT, "qmc_sampler", "qmc_sampler", {None, "core"}, forbidden=("vllm",))


def test_every_part_of_the_namespace_is_a_door_the_core_or_shared(package_folders):
    assert set(package_folders) == {"qmc_sampler", *(f"qmc_sampler.{name}" for name in (*DOORS, *SHARED))}
