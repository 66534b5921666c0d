"""README.md and docs/: every code block runs (or says why it cannot), every link resolves, and the
README's plot is redrawn from the committed result of ``make run``.

How blocks are marked and run: ``tests/docs_blocks.py``. Python blocks run here, each as a script
in a fresh process on the tiny test model; shell recipes run in the tests that already start
their servers and tools, which read them from the page (checked here: each ``example`` id is read
by some test).
"""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("docs_blocks", Path(__file__).with_name("docs_blocks.py"))
docs_blocks = sys.modules.setdefault("docs_blocks", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(docs_blocks)

ROOT = docs_blocks.ROOT
DOCS = docs_blocks.Docs()
PAGES = docs_blocks.pages()
RESULTS = ROOT / "docs" / "results"
RUNNABLE = [b for b in DOCS.blocks if b.kind is None and b.lang == "python"]
#: A test reads an example with one of these calls, its id a string literal.
READS = re.compile(r"""docs\.(?:commands|python|exec_python|block)\(\s*["']([\w.-]+)["']""")


def test_the_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_every_block_is_run_or_says_why_not():
    unmarked = [f"{b.where} ({b.lang or 'no language'})" for b in DOCS.blocks if b.kind is None and b.lang != "python"]
    assert not unmarked, f"blocks no test runs: mark them <!-- example: ID --> or <!-- not run: why -->: {unmarked}"
    for block in DOCS.blocks:
        if block.kind == "not run":
            assert len(block.value.split()) >= 3, f"{block.where}: say why it cannot run here"
        if block.kind == "output":
            lines = set((ROOT / block.value).read_text().splitlines())
            missing = [line for line in block.text.splitlines() if line not in lines]
            assert not missing, f"{block.where}: not in {block.value}: {missing}"
    ids = [b.value for b in DOCS.blocks if b.kind == "example"]
    assert len(ids) == len(set(ids)), f"example ids used twice: {sorted(ids)}"
    tests = Path(__file__).parent
    read = {m for path in tests.rglob("*.py") for m in READS.findall(path.read_text())}
    assert set(ids) <= read, f"examples no test reads: {sorted(set(ids) - read)}"
    assert read <= set(ids), f"tests read examples the pages no longer have: {sorted(read - set(ids))}"


def test_the_set_up_is_the_two_make_commands():
    readme = [b for b in DOCS.blocks if b.page.name == "README.md"]
    commands = [c.argv for b in readme if b.lang == "bash" for c in docs_blocks.shell_commands(b.text)]
    setup = [argv for argv in commands if argv[0] in ("make", "pip", "uv", "conda")]
    assert sorted(setup) == [["make", "run"], ["make", "test"]], setup
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert {"run", "test"} <= set(targets)


def test_commands_of_blocks_not_run_name_scripts_flags_and_targets_that_exist():
    """What cannot run here is still checked where it is cheap: a benchmark script and each of its
    flags, a Makefile target, ``qmc-eval``'s arguments (its own parser)."""
    from qmc_sampler.eval.cli import _parser

    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
    for block in (b for b in DOCS.blocks if b.kind == "not run" and b.lang == "bash"):
        for command in docs_blocks.shell_commands(block.text):
            argv = command.argv
            if argv[:1] == [sys.executable] and argv[1].startswith("benchmarks/"):
                script = ROOT / argv[1]
                assert script.is_file(), f"{block.where}: {argv[1]} does not exist"
                # A script's options may be declared in a package beside it that it imports (benchmarks/grpo/).
                text = script.read_text()
                packages = set(re.findall(r"^from (\w+)\.", text, re.MULTILINE))
                text += "".join(m.read_text() for name in packages if (script.parent / name / "__init__.py").is_file()
                                for m in sorted((script.parent / name).glob("*.py")))  # fmt: skip
                for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
                    assert f'"{flag}"' in text, f"{block.where}: {argv[1]} has no {flag}"
            elif argv[0] == "make":
                assert argv[1] in targets, f"{block.where}: no Makefile target {argv[1]}"
            elif argv[1:3] == ["-m", "qmc_sampler.eval"]:
                _parser().parse_args(argv[3:])


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_the_python_block_runs(block, tiny_model_dir, engine_core_env, tmp_path, warm_python):
    source = docs_blocks.substitute(block, {"path/to/model": tiny_model_dir} if "path/to/model" in block.text else {})
    script = tmp_path / f"{block.page.stem}_line_{block.line}.py"  # tracebacks name the page and the block's line
    script.write_text(source)
    # As `python SCRIPT` in a fresh interpreter (a fork of the warm one: torch and vLLM imported).
    done = warm_python.run([str(script)], env=engine_core_env | {"VLLM_CPU_KVCACHE_SPACE": "1"}, cwd=tmp_path,
                           timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{block.where} failed:\n{done.stderr[-3000:]}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def prose(page: Path) -> str:
    """The page without its code blocks (whose lines could look like headings or links)."""
    lines, inside = [], None
    for line in page.read_text().splitlines():
        fence = docs_blocks.FENCE.match(line)
        if fence and (inside is None or line.strip() == inside):
            inside = fence.group(1) if inside is None else None
            continue
        if inside is None:
            lines.append(line)
    return "\n".join(lines)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    text = re.sub(r"`[^`\n]*`", "", prose(page))  # links in code spans are not links
    broken = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check offline
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
            broken.append(target)
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def committed_reports():
    """``make run``'s pass@k table (``docs/results/passk.json``, from ``as_json``) as the reports ``plot`` draws."""
    from qmc_sampler.eval.reports.passk_report import SamplerReport

    return [
        SamplerReport(
            sampler=r["sampler"],
            n=r["n"],
            problems=r["problems"],
            groups=r["groups"],
            p_hat=r["p_hat"],
            curve={int(k): (v["value"], v["ci_low"], v["ci_high"]) for k, v in r["pass_at_k"].items()},
            bound={int(k): b for k, b in r["union_bound"].items()},
        )
        for r in json.loads((RESULTS / "passk.json").read_text())
    ]


def test_the_readme_plot_is_redrawn_from_the_committed_result(tmp_path):
    from qmc_sampler.eval.main_job import CONFIG
    from qmc_sampler.eval.reports.passk_report import plot

    from qmc_sampler.models import DEFAULT_MODEL_NAME

    png = tmp_path / "passk.png"
    plot(committed_reports(), str(png), title=f"{CONFIG.task}, {DEFAULT_MODEL_NAME}, n = {CONFIG.n}")  # as make run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert (ROOT / "docs" / "passk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_committed_table_is_the_committed_samples_and_the_readme_quotes_it():
    """The table's estimates are what ``make run``'s ``summarize`` gives for the committed samples (its
    bootstrap intervals, 2,000 resamples, are taken as committed: recomputing them takes 25 s), and
    the README's headline figure is the table's."""
    from qmc_sampler.eval.reports.passk_report import as_json, summarize
    from qmc_sampler.eval.runs.samples import correct_arrays, read_samples

    fresh = as_json(
        summarize(correct_arrays(read_samples(RESULTS / "samples.jsonl"), source=str(RESULTS)), resamples=50)
    )
    committed = json.loads((RESULTS / "passk.json").read_text())
    assert [r["sampler"] for r in fresh] == [r["sampler"] for r in committed]
    for new, old in zip(fresh, committed, strict=True):
        assert new["p_hat"] == pytest.approx(old["p_hat"]) and new["union_bound"] == pytest.approx(old["union_bound"])
        assert {k: v["value"] for k, v in new["pass_at_k"].items()} == pytest.approx(
            {k: v["value"] for k, v in old["pass_at_k"].items()}
        )
        assert {k: v["percent"] for k, v in new["samples_saved"].items()} == pytest.approx(
            {k: v["percent"] for k, v in old["samples_saved"].items()}
        )
    saved = next(r for r in committed if r["sampler"] == "lattice")["samples_saved"]["4"]
    low, high = saved["ci_low"], saved["ci_high"]
    headline = f"pass@4 with **{saved['percent']:.0f}% fewer samples** (95% CI {low:.0f}–{high:.0f}%"
    assert headline in " ".join((ROOT / "README.md").read_text().split())
