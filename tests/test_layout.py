"""The package's layers, read off its imports: the core (``qmc_sampler``, ``qmc_sampler.members``)
imports no door, no ``vllm_engine`` and no vLLM; ``qmc_sampler.vllm_engine`` (vLLM's touch points,
the start-up check) imports no door; and no door — the vLLM plugin, qmc-serve, qmc-eval, the
transformers path — imports another: what two doors share lives in the core or in ``vllm_engine``.

Read are the import statements (absolute, relative, inside functions), ``__import__`` and
``importlib.import_module`` with literal arguments; a relative one that resolves to nothing fails.
A module name computed at run time, or handed to vLLM as a string
(``logits_processors=['qmc_sampler.vllm_plugin:…']``), is not an import here."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOORS = ("vllm_plugin", "server", "eval", "hf")
SHARED = ("vllm_engine",)


#: What a relative import that no package resolves (a computed ``package``, or one that climbs past
#: the top-level package) stands for: a part of no layer, so no test lets it through.
UNRESOLVED = "<unresolved relative import>"


def imported(path: Path, package: str) -> set[str]:
    """The absolute names of the modules the Python file ``path`` imports, anywhere in it.

    Args:
        path: the file.
        package: the package the file belongs to once installed (``qmc_sampler.server`` for
            ``server/main.py``; the package itself for an ``__init__.py``): its ``__package__``,
            against which relative imports resolve.

    Returns:
        ``import a.b`` gives ``a.b``; ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (``c``
        may be a module); ``from ..x import y`` the same, resolved; ``import_module(name,
        package)`` and ``__import__(name, …, fromlist, level)`` with literal arguments
        (positional or keyword; ``__package__`` for the file's package) as those statements
        would. A relative name with no literal package, or one past the top-level package, gives
        :data:`UNRESOLVED`; a name computed at run time gives nothing.
    """

    def resolve(name: str, level: int, anchor: str | None) -> str:
        if level == 0:
            return name
        parts = anchor.split(".") if anchor else []
        if level > len(parts):
            return UNRESOLVED
        base = parts[: len(parts) - (level - 1)]
        return ".".join([*base, name] if name else base)

    def literal(node: ast.expr | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id == "__package__":
            return package
        return None

    def arguments(call: ast.Call, names: tuple[str, ...]) -> dict[str, ast.expr]:
        return dict(zip(names, call.args, strict=False)) | {k.arg: k.value for k in call.keywords if k.arg}

    def called(node: ast.AST) -> str | None:
        return getattr(node.func, "attr", getattr(node.func, "id", None)) if isinstance(node, ast.Call) else None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node.module or "", node.level, package)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names if module != UNRESOLVED)
        elif called(node) == "import_module":
            args = arguments(node, ("name", "package"))
            name = literal(args.get("name"))
            if name:
                stripped = name.lstrip(".")
                found.add(resolve(stripped, len(name) - len(stripped), literal(args.get("package"))))
        elif called(node) == "__import__":
            args = arguments(node, ("name", "globals", "locals", "fromlist", "level"))
            name, level = literal(args.get("name")), args.get("level")
            if name is None:
                continue
            if level is None:
                module = name
            elif isinstance(level, ast.Constant) and isinstance(level.value, int):
                module = resolve(name, level.value, package)
            else:
                module = UNRESOLVED
            found.add(module)
            fromlist = args.get("fromlist")
            if module != UNRESOLVED and isinstance(fromlist, ast.List | ast.Tuple):
                found.update(f"{module}.{item}" for item in map(literal, fromlist.elts) if item)
    return found


def part_of(name: str) -> str | None:
    """Which part of the package a module name belongs to (a door, ``vllm_engine``, ``core``;
    :data:`UNRESOLVED` for a relative import that resolves to nothing), or None for a module of
    another distribution."""
    if name == UNRESOLVED:
        return UNRESOLVED
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
        "importlib.import_module('.plan', package='qmc_sampler.eval')\n"
        "importlib.import_module('..vllm_plugin.adapters', __package__)\n"
        "__import__('qmc_sampler', fromlist=['members'])\n__import__('middleware', globals(), None, ['x'], 1)\n"
    )
    assert imported(source, "qmc_sampler.server") == {
        "os.path", "qmc_sampler.members", "qmc_sampler.members.keys", "qmc_sampler.vllm_plugin.hooks",
        "qmc_sampler.vllm_plugin.hooks.register", "importlib", "qmc_sampler.server.main",
        "qmc_sampler.server", "qmc_sampler.server.sibling", "qmc_sampler.hf", "qmc_sampler.hf.rows",
        "qmc_sampler", "qmc_sampler.eval", "qmc_sampler.vllm_engine", "qmc_sampler.server.fields",
        "qmc_sampler.eval.plan", "qmc_sampler.vllm_plugin.adapters", "qmc_sampler.server.middleware",
        "qmc_sampler.server.middleware.x",
    }  # fmt: skip
    # What cannot be resolved is kept, as a part no layer allows: a relative name without a literal
    # package, a level that is not a number, or one that climbs past the top-level package.
    source.write_text(
        "import_module('.x', package=pkg)\n__import__('y', globals(), None, [], level)\nfrom ...... import z\n"
    )
    assert imported(source, "qmc_sampler.server") == {UNRESOLVED}
    assert [part_of(n) for n in ("qmc_sampler", "qmc_sampler.members.keys", "qmc_sampler.hf", "vllm", UNRESOLVED)] == [
        "core", "core", "hf", None, UNRESOLVED,
    ]  # fmt: skip


def test_crossings_are_found_in_a_tree_laid_out_as_the_package(tmp_path):
    (tmp_path / "server" / "sub").mkdir(parents=True)
    (tmp_path / "server" / "fine.py").write_text("from qmc_sampler.vllm_engine import compat\nfrom . import other\n")
    (tmp_path / "server" / "sub" / "__init__.py").write_text("from .. import fields\n")  # qmc_sampler.server.fields
    (tmp_path / "server" / "sub" / "deep.py").write_text("def f():\n    from ...vllm_plugin import hooks\n")
    assert crossings(tmp_path, "qmc_sampler.server", "server", {None, "core", *SHARED, "server"}) == {
        "server/sub/deep.py": ["qmc_sampler.vllm_plugin", "qmc_sampler.vllm_plugin.hooks"]
    }
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "m.py").write_text("import numpy\ndef f():\n    import vllm.config\n")
    assert crossings(tmp_path, "qmc_sampler", "core", {None, "core"}, forbidden=("vllm",)) == {
        "core/m.py": ["vllm.config"]
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


#: ``qmc_sampler.eval``'s rooms → the rooms each may import besides itself (eval/__init__.py says why);
#: the front (the CLI, its console, the main job) may import every room, and no room imports the front.
EVAL_ROOMS: dict[str, set[str]] = {
    "stats": set(),
    "tasks": set(),
    "backends": set(),
    "runs": {"backends", "tasks"},
    "reports": {"stats", "runs"},
}
EVAL_FRONT = ("__init__.py", "__main__.py", "cli.py", "console.py", "main_job.py")


def eval_room_crossings(root: Path, folder: str = "eval") -> dict[str, list[str]]:
    """The imports of each eval room's files (``root/folder/ROOM/…``) into a part of ``qmc_sampler.eval``
    the room may not import (:data:`EVAL_ROOMS`), or — for ``stats`` — into any of ``qmc_sampler``, by file."""
    found = {}
    for room, allowed in EVAL_ROOMS.items():
        for path in sorted((root / folder / room).rglob("*.py")):
            inner = path.relative_to(root / folder).parent.parts
            names = imported(path, ".".join(["qmc_sampler.eval", *inner]))
            bad = []
            for name in names:
                pieces = name.split(".")
                if room == "stats" and pieces[0] == "qmc_sampler" and pieces[:3] != ["qmc_sampler", "eval", "stats"]:
                    bad.append(name)  # the statistics stand alone: nothing of the package
                elif name == UNRESOLVED or (pieces[:2] == ["qmc_sampler", "eval"] and
                                            (len(pieces) < 3 or pieces[2] not in {room, *allowed})):  # fmt: skip
                    bad.append(name)
            if bad:
                found[str(path.relative_to(root))] = sorted(bad)
    return found


def test_eval_room_crossings_are_found_in_a_tree_laid_out_as_eval(tmp_path):
    for room in EVAL_ROOMS:
        (tmp_path / "eval" / room).mkdir(parents=True)
    (tmp_path / "eval" / "runs" / "ok.py").write_text(
        "from qmc_sampler.eval.backends.generation import GroupJob\n"
        "from ..tasks import get_task\nfrom . import samples\n"
    )
    (tmp_path / "eval" / "runs" / "up.py").write_text(
        "def f():\n    from qmc_sampler.eval.reports import until_report\n"
    )
    (tmp_path / "eval" / "reports" / "front.py").write_text("from qmc_sampler.eval import cli\n")
    (tmp_path / "eval" / "stats" / "core.py").write_text("import numpy\nfrom qmc_sampler.designs import METHODS\n")
    (tmp_path / "eval" / "tasks" / "engine.py").write_text("from qmc_sampler.eval.backends import generation\n")
    assert eval_room_crossings(tmp_path) == {
        "eval/reports/front.py": ["qmc_sampler.eval", "qmc_sampler.eval.cli"],
        "eval/runs/up.py": ["qmc_sampler.eval.reports", "qmc_sampler.eval.reports.until_report"],
        "eval/stats/core.py": ["qmc_sampler.designs", "qmc_sampler.designs.METHODS"],
        "eval/tasks/engine.py": ["qmc_sampler.eval.backends", "qmc_sampler.eval.backends.generation"],
    }


def test_each_eval_room_imports_only_the_rooms_below_it(package_folders):
    assert not eval_room_crossings(ROOT, package_folders["qmc_sampler.eval"])


def test_every_eval_module_is_in_a_room_or_the_front(package_folders):
    folder = ROOT / package_folders["qmc_sampler.eval"]
    loose = sorted(p.name for p in folder.glob("*.py") if p.name not in EVAL_FRONT)
    rooms = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert not loose and rooms == sorted(EVAL_ROOMS), (loose, rooms)
    assert all((folder / room / "__init__.py").is_file() for room in EVAL_ROOMS)
