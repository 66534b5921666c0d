"""``qmc-eval run`` on a real vLLM engine (tiny model): samples, member indices, resume, settings guard."""

import json
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
pytest.importorskip("reasoning_gym", reason="eval extra not installed")

from qmc_sampler.eval.backends.generation import InProcessBackend
from qmc_sampler.eval.runs.runner import RunConfig, RunError, group_seed, run
from qmc_sampler.eval.runs.samples import correct_arrays, read_samples
from qmc_sampler.eval.tasks.catalog import get_task

from qmc_sampler import GroupSpec, sample_group

pytestmark = pytest.mark.vllm


class CountingBackend(InProcessBackend):
    """The real in-process backend, counting the groups it is given (a spy, not a stand-in)."""

    def __init__(self, llm):
        super().__init__(llm)
        self.groups = 0

    def run(self, jobs, on_group):
        jobs = list(jobs)
        self.groups += len(jobs)
        super().run(jobs, on_group)


@pytest.fixture(scope="module")
def llm(llm_factory, tiny_model_dir):
    engine = llm_factory(tiny_model_dir, max_model_len=512)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def config(out, **kw):
    return RunConfig(
        **(
            {
                "task": "basic_arithmetic",
                "samplers": ("iid", "lattice"),
                "n": 4,
                "groups": 2,
                "problems": 3,
                "out": str(out),
                "max_tokens": 6,
                "max_members_in_flight": 12,
            }
            | kw
        )
    )


def lines(path):
    return sorted(path.read_text().splitlines())


def test_every_sample_is_written_with_its_group_and_score(llm, tmp_path):
    out = run(config(tmp_path / "a"), engine=llm, progress=False)
    records = read_samples(out / "samples.jsonl")
    assert len(records) == 2 * 3 * 2 * 4
    r = records[0]
    assert set(r) == {"task", "problem", "sampler", "group", "group_seed", "member", "n", "text", "finish_reason",
                      "score", "failure"}  # fmt: skip
    assert {rec["finish_reason"] for rec in records} <= {"stop", "length"}
    assert all((rec["failure"] is None) == rec["score"] for rec in records)
    assert r["group_seed"] == group_seed(0, "basic_arithmetic", r["problem"], r["group"])
    cells = correct_arrays(records)
    assert {c.correct.shape for c in cells} == {(2, 4)}
    assert json.loads((out / "run.json").read_text())["samplers"] == ["iid", "lattice"]


def test_an_interrupted_run_resumes_without_redoing_finished_groups(llm, tmp_path):
    full = run(config(tmp_path / "full"), engine=llm, progress=False) / "samples.jsonl"
    part = tmp_path / "part"
    part.mkdir()
    (part / "run.json").write_text((tmp_path / "full" / "run.json").read_text())
    kept = full.read_text().splitlines(keepends=True)[: 5 * 4]  # five finished groups...
    torn = full.read_text().splitlines(keepends=True)[5 * 4][:17]  # ...and a write cut mid-line
    (part / "samples.jsonl").write_text("".join(kept) + torn)
    spy = CountingBackend(llm)
    run(config(part), backend=spy, progress=False)
    assert spy.groups == 12 - 5
    assert lines(part / "samples.jsonl") == lines(full)
    spy.groups = 0
    run(config(part), backend=spy, progress=False)  # complete: nothing to do
    assert spy.groups == 0


def test_members_are_recorded_by_their_true_index(llm, hf_model, tmp_path):
    # Each member is its own request with qmc_index, so record i is member i of the
    # design whatever order the engine finishes them in: it equals the reference loop.
    cfg = config(tmp_path / "m", samplers=("lattice",), problems=1, groups=1, n=8, temperature=1.5)
    records = read_samples(run(cfg, engine=llm, progress=False) / "samples.jsonl")
    tokenizer = llm.get_tokenizer()
    problem = get_task("basic_arithmetic").problems(1, 0)[0]
    text = tokenizer.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)

    def next_logits(prefixes):
        import torch

        with torch.no_grad():
            return torch.cat([hf_model(torch.tensor([list(prompt) + p])).logits[0, -1:] for p in prefixes])

    seed = group_seed(0, "basic_arithmetic", 0, 0)
    spec = GroupSpec("lattice", 8, seed)
    reference = sample_group(next_logits, spec, 6, temperature=1.5, eos_token_id=tokenizer.eos_token_id)
    texts = {r["member"]: r["text"] for r in records}
    assert len(set(texts.values())) > 1
    for member, tokens in enumerate(reference):
        # the engine also stops at "</answer>", which the reference loop does not know
        assert tokenizer.decode(tokens, skip_special_tokens=True).startswith(texts[member]), member


def test_resuming_with_other_settings_is_refused(llm, tmp_path):
    run(config(tmp_path / "a", problems=1, groups=1), engine=llm, progress=False)
    with pytest.raises(RunError, match=r"holds a run with other settings \(n differ\); use another --out"):
        run(config(tmp_path / "a", problems=1, groups=1, n=8), engine=llm, progress=False)


def test_the_cli_runs_end_to_end(tiny_model_dir, tmp_path, engine_core_env, docs, capsys, warm_python):
    from qmc_sampler.eval.cli import main as cli_main

    # The README's two commands, on the tiny model and smaller; the run in a fresh interpreter (a
    # fork of the warm one: torch and vLLM imported).
    out = tmp_path / "cli"
    run_command, score_command = docs.commands("readme-qmc-eval", {"runs/arith": str(out)})
    assert run_command.argv[:2] == [sys.executable, "-m"], run_command.argv
    done = warm_python.run(
        [*run_command.argv[1:], "--n", "4", "--problems", "2", "--model", tiny_model_dir, "--max-tokens", "4",
         "--quiet"],
        env=engine_core_env | {"VLLM_CPU_KVCACHE_SPACE": "1"},  # the model in the CLI's process: ~20 s less
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bound min(1,k·p̂)" in done.stdout
    assert len(read_samples(out / "samples.jsonl")) == 2 * 2 * 4
    assert score_command.argv[1:3] == ["-m", "qmc_sampler.eval"] and cli_main(score_command.argv[3:]) == 0
    assert "lattice" in capsys.readouterr().out and (out / "passk.png").read_bytes()[:4] == b"\x89PNG"


def test_until_correct_grows_each_group_in_rounds_of_its_true_members(llm, hf_model, tmp_path, capsys):
    # --until-correct: round j sends members [2j, 2j + 2) of one lattice group of 8; each is member i
    # of the design (equal to the reference loop's member i), and a problem stops at its first
    # correct member's round. The verifier (a regex) passes some of the tiny model's texts, not all.
    # Texts are compared with the reference loop's (transformers, one prefix at a time): the engine's
    # batched logits differ from those in the last bits, and the carry can turn that into another
    # token a few steps on; so one member in ten (at least one) may part from its reference text after
    # its first character, never more (a member sent with another's index shares its reference's
    # text only by chance).
    from qmc_sampler.eval.cli import main as cli_main

    task_file = tmp_path / "t.jsonl"
    task_file.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {w}:", "answer": "[ae]"}) + "\n"
                                 for i, w in enumerate(("hello", "there", "friend"))))  # fmt: skip
    options = {"verifier": "regex"}
    cfg = config(tmp_path / "u", task=f"jsonl:{task_file}", task_options=options, problems=3, groups=1, n=8,
                 temperature=1.5, until_correct=1, round_size=2)  # fmt: skip
    records = read_samples(run(cfg, engine=llm, progress=False) / "samples.jsonl")
    tokenizer = llm.get_tokenizer()
    task = get_task(cfg.task, **options)
    parted = []  # (member, its text, its reference text) where the text is not the reference's start
    checked = 0
    for problem in task.problems(3, 0):
        prompt = tokenizer.encode(problem.prompt)

        def next_logits(prefixes, prompt=prompt):
            import torch

            with torch.no_grad():
                return torch.cat([hf_model(torch.tensor([list(prompt) + p])).logits[0, -1:] for p in prefixes])

        seed = group_seed(0, cfg.task, problem.problem_id, 0)
        reference = sample_group(next_logits, GroupSpec("lattice", 8, seed), 6, temperature=1.5,
                                 eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        mine = sorted((r for r in records if r["sampler"] == "lattice" and r["problem"] == problem.problem_id),
                      key=lambda r: r["member"])  # fmt: skip
        assert [r["member"] for r in mine] == list(range(len(mine))) and [r["round"] for r in mine] == [
            m // 2 for m in range(len(mine))
        ]
        for r in mine:
            expected = tokenizer.decode(reference[r["member"]], skip_special_tokens=True)
            checked += 1
            if not expected.startswith(r["text"]):
                parted.append((problem.problem_id, r["member"], r["text"], expected))
        scores = [r["score"] for r in mine]
        first = scores.index(True) + 1 if True in scores else None
        assert len(mine) == (8 if first is None else -(-first // 2) * 2)
    assert len(parted) <= max(1, checked // 10), (checked, parted)
    assert all(text[:1] == expected[:1] for *_, text, expected in parted), parted  # parted later, not at once
    assert any(r["round"] >= 1 for r in records if r["sampler"] == "lattice")  # later rounds were checked too
    assert {r["sampler"] for r in records} == {"iid", "lattice"}
    assert any(r["score"] for r in records) and not all(r["score"] for r in records)
    assert cli_main(["score", cfg.out, "--resamples", "200"]) == 0
    assert "samples to 1 correct (cap 8, rounds of 2)" in capsys.readouterr().out


def test_group_seeds_are_the_ones_the_committed_run_was_made_with():
    # `make run` resumes into docs/results' settings: its groups must keep the seeds they were drawn with.
    from pathlib import Path

    results = Path(__file__).resolve().parents[3] / "docs" / "results"
    run_seed = json.loads((results / "run.json").read_text())["seed"]
    records = read_samples(results / "samples.jsonl")
    seeds = {(r["task"], r["problem"], r["group"]): r["group_seed"] for r in records}
    assert len(seeds) >= 48 and all(group_seed(run_seed, *key) == seed for key, seed in seeds.items())
