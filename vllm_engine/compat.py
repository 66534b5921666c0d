"""Every place qmc-sampler touches vLLM, as one table, checked at run time and against a release's sources.

Each :class:`Touchpoint` names a vLLM object (``module:qualname``, with alternatives where vLLM
moved it) and, for functions we wrap, the parameter list we rely on. :func:`locate` resolves one
in the running vLLM (what the plugin's ``logprobs`` and ``hooks`` and ``qmc-serve`` do before
patching or importing anything); :func:`check_sources` reads the same table off a vLLM tree or wheel *without
importing it* (``python -m qmc_sampler.vllm_engine.compat WHEEL_OR_DIR``: how CI checks a release
it cannot install, such as the CUDA wheel). Which vLLM releases were run, and what each gives:
docs/serving.md, "vLLM versions".
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "INTERFACES",
    "TOUCHPOINTS",
    "Touchpoint",
    "TouchpointError",
    "check_sources",
    "engine_runner",
    "find",
    "find_all",
    "interface_problem",
    "locate",
    "locate_with_owner",
    "main",
    "present",
    "runner_problem",
]


@dataclass(frozen=True)
class Touchpoint:
    """One vLLM object the package relies on.

    Attributes:
        name: short key (used in logs, docs and :func:`locate`).
        places: ``"module:qualname"`` candidates, newest vLLM first; the first found is used.
        params: the parameter names a wrapped function must have (None: only its presence).
        feature: what is lost without it (said in the log line and by the source check).
        optional: absent on some supported releases by design (the feature then has a fallback
            that the plugin's ``hooks`` or the server applies and says so); a mismatched signature
            is never optional.
        only_with: another touch point's name: this one is needed only where that one exists
            (MRV2's sampler matters only on releases whose MRV2 runs logits processors).
        fields: for a class, the attributes the package reads off its instances (dataclass fields,
            class-level annotations or ``self.name = …`` in its methods); None: not checked.
    """

    name: str
    places: tuple[str, ...]
    params: tuple[str, ...] | None
    feature: str
    optional: bool = False
    only_with: str | None = None
    fields: tuple[str, ...] | None = None


_V1_SAMPLE = ("self", "logits", "sampling_metadata", "logprobs_mode_override")
_V2_SAMPLE = (
    "self",
    "logits",
    "expanded_idx_mapping",
    "idx_mapping",
    "idx_mapping_np",
    "pos",
    "input_ids",
    "expanded_local_pos",
    "seq_lens_upper_bound_np",
    "return_logprobs",
)

_V1 = "the plugin under the V1 runner (vLLM < 0.34: every CPU engine)"
_MRV2 = "the plugin under Model Runner V2 (vLLM >= 0.31; the only runner from 0.34)"
_MRV2_LP = "vllm.v1.worker.gpu.sample.logits_processor"

TOUCHPOINTS: dict[str, Touchpoint] = {
    t.name: t
    for t in (
        # The V1 runner: gone in vLLM 0.34 (its sampler with it), so optional; where it runs, its interface is
        # required.
        Touchpoint("v1_runner", ("vllm.v1.sample.sampler:Sampler",), None, "the V1 runner", optional=True),
        Touchpoint("v1_processor", ("vllm.v1.sample.logits_processor:LogitsProcessor",), None, _V1,
                   only_with="v1_runner"),
        Touchpoint("batch_update", ("vllm.v1.sample.logits_processor:BatchUpdate",), None, _V1,
                   only_with="v1_processor"),
        Touchpoint("move_directionality", ("vllm.v1.sample.logits_processor.interface:MoveDirectionality",), None,
                   _V1, only_with="v1_processor"),
        Touchpoint("v1_sample", ("vllm.v1.sample.sampler:Sampler.sample",), _V1_SAMPLE,
                   "correct processed logprobs of designed rows under the V1 runner", only_with="v1_processor"),
        Touchpoint("apply_top_k_top_p", ("vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p",), None,
                   "correct processed logprobs of designed rows under the V1 runner", only_with="v1_processor"),
        # Model Runner V2: absent before 0.31 (no MRV2 logits processors); everything its adapter reads.
        Touchpoint("mrv2_processor", (f"{_MRV2_LP}:LogitsProcessor", f"{_MRV2_LP}.loader:LogitsProcessor"), None,
                   "the plugin under Model Runner V2 (vLLM < 0.31 has no MRV2 logits processors: vLLM then "
                   "runs the V1 runner wherever a logits-processor entry point is installed)", optional=True),
        Touchpoint("mrv2_init", (f"{_MRV2_LP}:LogitsProcessor.__init__",), ("self", "vllm_config", "req_states"),
                   _MRV2, only_with="mrv2_processor"),
        Touchpoint("mrv2_add_request", (f"{_MRV2_LP}:LogitsProcessor.add_request",),
                   ("self", "req_idx", "sampling_params"), _MRV2, only_with="mrv2_processor"),
        Touchpoint("mrv2_apply_staged_writes", (f"{_MRV2_LP}:LogitsProcessor.apply_staged_writes",), ("self",),
                   _MRV2, only_with="mrv2_processor"),
        Touchpoint("mrv2_apply", (f"{_MRV2_LP}:LogitsProcessor.apply",), ("self", "logits", "ctx"), _MRV2,
                   only_with="mrv2_processor"),
        Touchpoint("mrv2_context", (f"{_MRV2_LP}:LogitsContext",), None, _MRV2, only_with="mrv2_processor",
                   fields=("idx_mapping_np", "seq_lens_upper_bound_np", "input_ids")),
        Touchpoint("mrv2_request_state", (f"{_MRV2_LP}:LogitsProcRequestState",), None, _MRV2,
                   only_with="mrv2_processor", fields=("prompt_len", "prefill_len", "all_token_ids")),
        Touchpoint("mrv2_host_buffer", ("vllm.v1.worker.gpu.buffer_utils:UvaBackedTensor",), None,
                   _MRV2 + ": prompt_len and prefill_len read on the host", only_with="mrv2_processor",
                   fields=("np",)),
        Touchpoint("mrv2_token_buffer", ("vllm.v1.worker.gpu.buffer_utils:StagedWriteTensor",), None,
                   _MRV2 + ": a request's tokens read at admission", only_with="mrv2_processor", fields=("gpu",)),
        Touchpoint("mrv2_sample", ("vllm.v1.worker.gpu.sample.sampler:Sampler.sample",), _V2_SAMPLE,
                   "correct processed logprobs of designed rows under Model Runner V2", only_with="mrv2_processor"),
        Touchpoint("mrv2_sampler", ("vllm.v1.worker.gpu.sample.sampler:Sampler",), None,
                   "correct processed logprobs of designed rows under Model Runner V2", only_with="mrv2_processor",
                   fields=("logits_processors", "logprobs_mode")),
        Touchpoint("standalone_cpu_runner", ("vllm.platforms.interface:Platform.uses_standalone_cpu_model_runner",),
                   None, "seeing that a CPU engine runs vLLM's standalone runner, which runs no custom logits "
                   "processors (vLLM >= 0.34 on non-x86 CPUs without Triton)", optional=True),
        Touchpoint("mrv2_unsupported", ("vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",),
                   ("self",), "keeping Model Runner V2 on vLLM < 0.31 where VLLM_USE_V2_MODEL_RUNNER=1 asks for it",
                   optional=True),
        Touchpoint("params_validator",
                   ("vllm.v1.engine.input_processor:InputProcessor._build_logits_processors_params_validator",),
                   ("self",), "admission-time engine facts on vLLM >= 0.31 (older: SamplingParams.verify)",
                   optional=True),
        Touchpoint("params_verify", ("vllm.sampling_params:SamplingParams.verify",),
                   ("self", "model_config", "speculative_config", "structured_outputs_config", "tokenizer"),
                   "admission-time engine facts on vLLM < 0.31 (refusing designs vLLM cannot serve)"),
        Touchpoint("prompt_marks", ("vllm.entrypoints.serve.engine.serving:BaseServing._log_inputs",),
                   ("self", "request_id", "inputs", "params", "lora_request"),
                   "telling apart the prompts of one multi-prompt request (request_args.install_prompt_marks)"),
        Touchpoint("child_info", ("vllm.v1.engine.parallel_sampling:ParentRequest.get_child_info",), ("self", "index"),
                   "numbering an n > 1 request's children in the front end, whatever engine runs each "
                   "(request_args.install_child_marks)"),
        Touchpoint("worker_base", ("vllm.v1.worker.worker_base:WorkerBase",), None,
                   "asking every worker whether it runs the processor (servers, qmc-eval)"),
        Touchpoint("serve_cli_args", ("vllm.entrypoints.common.cli_args:make_arg_parser",
                                      "vllm.entrypoints.launchers.cli_args:make_arg_parser",
                                      "vllm.entrypoints.openai.cli_args:make_arg_parser"),
                   ("parser",), "qmc-serve's command line"),
        Touchpoint("serve_validate_args", ("vllm.entrypoints.common.cli_args:validate_parsed_serve_args",
                                           "vllm.entrypoints.launchers.cli_args:validate_parsed_serve_args",
                                           "vllm.entrypoints.openai.cli_args:validate_parsed_serve_args"),
                   ("args",), "qmc-serve's command line"),
        Touchpoint("cli_env_setup", ("vllm.entrypoints.common.startup:cli_env_setup",
                                     "vllm.entrypoints.serve.utils.api_utils:cli_env_setup"),
                   (), "qmc-serve's start"),
        Touchpoint("async_unfinished", ("vllm.v1.engine.async_llm:AsyncLLM.get_num_unfinished_requests",), ("self",),
                   "qmc-serve (its /stats and graceful shutdown; vLLM >= 0.29): the plugin itself runs under "
                   "vllm serve", optional=True),
        Touchpoint("serve_subcommand", ("vllm.entrypoints.cli.serve:ServeSubcommand.cmd",), ("args",),
                   "qmc-serve's start"),
        Touchpoint("configure_logging", ("vllm.logger:configure_logging_from_args",), ("args",),
                   "vLLM >= 0.31's logging options in qmc-serve (older vLLMs configure logging themselves)",
                   optional=True),
        Touchpoint("authentication", ("vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware",
                                      "vllm.entrypoints.serve.utils.server_utils:AuthenticationMiddleware"),
                   None, "qmc-serve's API-key check on its own routes"),
        Touchpoint("guarded_prefix", ("vllm.entrypoints.serve.middleware.authenticate:GUARDED_PREFIX",
                                      "vllm.entrypoints.serve.utils.server_utils:GUARDED_PREFIX"),
                   None, "qmc-serve's API-key check on its own routes"),
    )
}  # fmt: skip


class TouchpointError(LookupError):
    """A touch point is absent from the running vLLM, or its signature differs."""


def locate(name: str) -> Any:
    """The running vLLM's object for touch point ``name``.

    Args:
        name: a key of :data:`TOUCHPOINTS`.

    Returns:
        The object at the first of its places that exists (a wrapped function is checked by
        the signature of what it wraps).

    Raises:
        TouchpointError: none of its places exists, or the object's parameters differ from the
            ones relied on; the message says which and what is lost.
    """
    return locate_with_owner(name)[1]


def present(name: str) -> bool:
    """Whether touch point ``name`` is in the running vLLM as the table expects it (:func:`locate` succeeds)."""
    try:
        locate(name)
    except TouchpointError:
        return False
    return True


def find(name: str) -> Any | None:
    """:func:`locate`, or None where touch point ``name`` is absent or changed (never raises)."""
    try:
        return locate(name)
    except TouchpointError:
        return None


def find_all(name: str) -> list[Any]:
    """Every distinct object at touch point ``name``'s places that exist (a class vLLM re-exports under
    several names counts once; one moved while a module kept the old name gives two)."""
    found: list[Any] = []
    for place in TOUCHPOINTS[name].places:
        module_name, qualname = place.split(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for attr in qualname.split("."):
                obj = getattr(obj, attr)
        except (ImportError, AttributeError):
            continue
        if not any(obj is seen for seen in found):
            found.append(obj)
    return found


#: Each logits-processor interface of vLLM's runners and every touch point the plugin's adapter for it
#: reads; the plugin serves an interface only where all of them are as the table expects.
INTERFACES: dict[str, tuple[str, ...]] = {
    "v1": ("v1_processor", "batch_update", "move_directionality"),
    "mrv2": ("mrv2_processor", "mrv2_init", "mrv2_add_request", "mrv2_apply_staged_writes", "mrv2_apply",
             "mrv2_context", "mrv2_request_state", "mrv2_host_buffer", "mrv2_token_buffer"),
}  # fmt: skip


def interface_problem(runner: str) -> str | None:
    """Why the plugin cannot serve ``runner``'s logits-processor interface on the running vLLM.

    Args:
        runner: ``"v1"`` or ``"mrv2"`` (a key of :data:`INTERFACES`).

    Returns:
        None where every touch point of the interface is there as expected, else one line naming the
        first one that is not (absent, or another signature or fields).
    """
    for name in INTERFACES[runner]:
        try:
            locate(name)
        except TouchpointError as e:
            return str(e)
    return None


def engine_runner(vllm_config: Any = None) -> str:
    """The runner whose logits-processor interface an engine of the running vLLM uses: ``"mrv2"`` where
    the V1 runner is gone (vLLM >= 0.34) or the engine's config chose Model Runner V2, else ``"v1"``."""
    if not present("v1_processor"):
        return "mrv2"
    return "mrv2" if getattr(vllm_config, "use_v2_model_runner", False) else "v1"


def runner_problem(runner: str) -> str | None:
    """Why an engine of this process's vLLM platform on ``runner`` would not run the plugin, or None.

    :func:`interface_problem`, and on vLLM >= 0.34 the platform's standalone CPU runner (non-x86 CPUs
    without Triton), whose sampler runs no custom logits processors at all.
    """
    problem = interface_problem(runner)
    if problem is not None or runner != "mrv2" or not present("standalone_cpu_runner"):
        return problem
    try:
        from vllm.platforms import current_platform

        standalone = bool(current_platform.uses_standalone_cpu_model_runner())
    except Exception as e:  # a platform that cannot say: the plugin must not guess that it runs
        return f"vLLM's platform cannot say which CPU runner it uses ({type(e).__name__}: {e})"
    if standalone:
        return ("this CPU runs vLLM's standalone Model Runner V2 (no Triton), which runs no custom logits processors; "
                "x86 CPUs and GPUs run the plugin")
    return None


def locate_with_owner(name: str) -> tuple[Any, Any]:
    """:func:`locate`, also returning what holds the object (its class or module), for patching it."""
    point = TOUCHPOINTS[name]
    missing = []
    for place in point.places:
        module_name, qualname = place.split(":")
        try:
            owner: Any = None
            obj: Any = importlib.import_module(module_name)
            for attr in qualname.split("."):
                owner, obj = obj, getattr(obj, attr)
        except (ImportError, AttributeError) as e:
            missing.append(f"{place} ({type(e).__name__})")
            continue
        if point.params is not None:
            found = _runtime_params(obj)
            if found != point.params:
                raise TouchpointError(f"{place} has parameters {found}, not {point.params}: {point.feature} is off")
        known = _runtime_fields(obj) if point.fields is not None else None
        if point.fields is not None and known is not None:
            lacking = [f for f in point.fields if f not in known]
            if lacking:
                raise TouchpointError(f"{place} has no {', '.join(lacking)}: {point.feature} is off")
        return owner, obj
    raise TouchpointError(f"{' / '.join(missing)} not found: {point.feature} is off")


def _runtime_params(obj: Any) -> tuple[str, ...] | None:
    # inspect.signature follows __wrapped__: a function we wrapped earlier shows vLLM's own.
    try:
        return tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # not introspectable: reported as another signature
        return None


def _runtime_fields(cls: Any) -> set[str] | None:
    """The attributes instances of ``cls`` have, read as :func:`check_sources` reads them (plus what the
    class and its bases define); None where a class's source cannot be read (a deployment of compiled
    files only): its instance attributes are then unknown, and not held against it."""
    names: set[str] = set()
    for klass in getattr(cls, "__mro__", (cls,)):
        if klass is object:
            continue
        names |= set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            return None
        names |= _class_fields(tree.body[0]) if tree.body and isinstance(tree.body[0], ast.ClassDef) else set()
    return names


def _class_fields(node: ast.ClassDef) -> set[str]:
    """A class body's annotated names, plain class attributes and ``self.name = …`` targets in its methods."""
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(item.name)
            for sub in ast.walk(item):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                    sub, ast.AnnAssign | ast.AugAssign) else []  # fmt: skip
                names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                          and t.value.id == "self"}  # fmt: skip
    return names


# ---- the same table, read off sources without importing them ------------------------------------


def check_sources(root: str | Path) -> dict[str, str]:
    """Check every touch point against a vLLM source tree or wheel, importing nothing.

    Args:
        root: a folder that holds ``vllm/`` (an unpacked wheel or a checkout), or a ``.whl`` file.

    Returns:
        ``{name: verdict}``, a verdict being ``"ok"``, ``"absent (optional)"``, ``"not needed
        (…)"``, or a problem starting with ``"MISSING"`` or ``"SIGNATURE"``; and under
        ``"interfaces"``, the logits-processor interfaces (:data:`INTERFACES`) the plugin can serve
        there, or ``"MISSING …"`` where it can serve none.
    """
    read = _wheel_reader(Path(root)) if str(root).endswith(".whl") else _folder_reader(Path(root))
    verdicts: dict[str, str] = {}
    for point in TOUCHPOINTS.values():  # a prerequisite comes earlier in the table
        verdict = None
        if point.only_with and verdicts.get(point.only_with) != "ok":
            verdicts[point.name] = f"not needed (no {point.only_with})"
            continue
        for place in point.places:
            node = _find_in_sources(read, *place.split(":"))
            if node is None:
                continue
            found = _params(node)
            lacking = [f for f in point.fields or () if f not in _fields(node)]
            if point.params is not None and found != point.params:
                verdict = f"SIGNATURE {place}: {found}, expected {point.params}"
            elif lacking:
                verdict = f"SIGNATURE {place}: no {', '.join(lacking)}"
            else:
                verdict = "ok"
            break
        if verdict is None:
            verdict = "absent (optional)" if point.optional else f"MISSING {' / '.join(point.places)}"
        verdicts[point.name] = verdict
    verdicts["loaders"] = _loaders_verdict(root, read, verdicts)
    served = [runner for runner, names in INTERFACES.items() if all(verdicts[n] == "ok" for n in names)]
    verdicts["interfaces"] = (
        ", ".join(served)
        if served
        else "MISSING: no logits-processor interface the plugin knows (V1 runner or Model Runner V2)"
    )
    return verdicts


Reader = Callable[[str], str | None]

#: The entry-point group vLLM's loaders read: each checks a loaded class against its runner's base class.
_GROUP = "vllm.logits_processors"


def _loaders_verdict(root: str | Path, read: Reader, verdicts: dict[str, str]) -> str:
    """Each module of the release that loads :data:`_GROUP` checks classes against the ``LogitsProcessor``
    it imports: that class must be one the plugin subclasses (a base moved while its loader stayed would
    make every engine refuse the plugin's class at start)."""
    ours = set()
    for name in ("v1_processor", "mrv2_processor"):
        if verdicts.get(name) == "ok":
            ours |= {_defining(read, *place.split(":")) for place in TOUCHPOINTS[name].places}
    ours.discard(None)
    wrong = []
    for module in _modules_mentioning(root, _GROUP):
        checked = _defining(read, module, "LogitsProcessor")
        if checked is not None and checked not in ours:
            wrong.append(f"{module} checks {checked[0]}:{checked[1]}")
    return f"MISSING base class: {'; '.join(wrong)}" if wrong else "ok"


def _modules_mentioning(root: str | Path, text: str) -> list[str]:
    path = Path(root)
    if str(root).endswith(".whl"):
        with zipfile.ZipFile(path) as archive:
            files = [(n, archive.read(n)) for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    else:
        files = [(p.relative_to(path).as_posix(), p.read_bytes()) for p in sorted(path.glob("vllm/**/*.py"))]
    found = [n for n, data in files if f'"{text}"'.encode() in data]
    return [n.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for n in found]


def _defining(read: Reader, module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
    """Where ``module``'s ``name`` is defined as a class, following ``from X import name`` within vLLM."""
    source = _module_source(read, module)
    if source is None or depth > 4:
        return None
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    origin = _absolute(module, node, source_is_package=_is_package(read, module))
                    if origin and origin.startswith("vllm"):
                        return _defining(read, origin, alias.name, depth + 1)
    return None


def _folder_reader(root: Path) -> Reader:
    def read(relative: str) -> str | None:
        path = root / relative
        return path.read_text(encoding="utf-8") if path.is_file() else None

    return read


def _wheel_reader(wheel: Path) -> Reader:
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())

    def read(relative: str) -> str | None:
        return archive.read(relative).decode("utf-8") if relative in names else None

    return read


def _module_source(read: Reader, module: str) -> str | None:
    base = module.replace(".", "/")
    return read(f"{base}.py") or read(f"{base}/__init__.py")


def _params(node: ast.AST) -> tuple[str, ...]:
    """A function's parameters in :func:`inspect.signature`'s order (``()`` for a class or a value)."""
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return ()
    args = node.args
    # In inspect.signature's order, so the static check and locate() agree on *args/**kwargs too.
    star = [args.vararg] if args.vararg else []
    return tuple(a.arg for a in [*args.posonlyargs, *args.args, *star, *args.kwonlyargs,
                                 *([args.kwarg] if args.kwarg else [])])  # fmt: skip


def _fields(node: ast.AST) -> set[str]:
    return _class_fields(node) if isinstance(node, ast.ClassDef) else set()


def _find_in_sources(read: Reader, module: str, qualname: str, depth: int = 0) -> ast.AST | None:
    """The definition of ``module:qualname`` (a class, function or assignment), or None if absent.

    Follows ``from X import name`` re-exports within vLLM (a package's ``__init__``)."""
    source = _module_source(read, module)
    if source is None or depth > 4:
        return None
    tree = ast.parse(source)
    head, *rest = qualname.split(".")
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == head:
                    origin = _absolute(module, node, source_is_package=_is_package(read, module))
                    if origin and origin.startswith("vllm"):
                        return _find_in_sources(read, origin, ".".join([alias.name, *rest]), depth + 1)
    return _lookup(tree.body, [head, *rest])


def _lookup(body: Iterable[ast.stmt], path: list[str]) -> ast.AST | None:
    for node in body:
        names: list[str] = []
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        if path[0] in names:
            if len(path) == 1:
                return node
            if isinstance(node, ast.ClassDef):
                return _lookup(node.body, path[1:])
            return None
    return None


def _is_package(read: Reader, module: str) -> bool:
    return read(f"{module.replace('.', '/')}/__init__.py") is not None


def _absolute(module: str, node: ast.ImportFrom, source_is_package: bool) -> str | None:
    if not node.level:
        return node.module
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if source_is_package else 0)
    base = parts[:keep]
    return ".".join([*base, node.module] if node.module else base)


def main(argv: list[str] | None = None) -> int:
    """``python -m qmc_sampler.vllm_engine.compat WHEEL_OR_DIR [...]``: print each touch point's
    verdict per release; exit 1 if any is missing or changed, 2 on a bad path."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m qmc_sampler.vllm_engine.compat WHEEL_OR_DIR [...]", file=sys.stderr)
        return 2
    failed = False
    for path in paths:
        if not Path(path).exists():
            print(f"compat: {path}: no such wheel or folder", file=sys.stderr)
            return 2
        verdicts = check_sources(path)
        print(f"{path}:")
        for name, verdict in verdicts.items():
            print(f"  {name:26s} {verdict}")
            failed |= verdict.startswith(("MISSING", "SIGNATURE"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
