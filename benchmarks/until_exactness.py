"""What sample-until returns, against p(· | correct), on models whose distribution is exact.

For every design and both modes of :func:`qmc_sampler.eval.sample_until` (``first``: one
group, the first correct member; ``unbiased``: a group per round, every correct member),
the returned samples of ``--prompts`` prompts are compared with p(· | correct) by the
per-prompt Wald χ² and the total variation of tests/eval/runs/test_sequential.py (whose models
and statistic this script runs): the toy of tests/conftest.py (vocabulary 4, three steps,
correct where the tokens sum to 0 mod 3; cap 4, rounds of 2) and the constructed one-step
case (probabilities .05/.45/.45/.05, tokens 0 and 2 correct; cap 2, rounds of 1).

    python benchmarks/until_exactness.py [--prompts 4000] [--seed 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    conftest = _load("qmc_tests_conftest", TESTS / "conftest.py")
    cases = _load("qmc_tests_sequential", TESTS / "eval" / "runs" / "test_sequential.py")
    toy = conftest.make_toy_model(vocab=4, depth=3, seed=1234)
    print(f"{'model':<32} {'mode':<9} {'design':<11} {'p-value':>8} {'TV':>6} {'spent':>6}")
    for label, case, cap, r in (
        ("toy, 3 steps (cap 4, rounds 2)", cases.toy_case(toy), 4, 2),
        ("constructed (cap 2, rounds 1)", cases.constructed_case(), 2, 1),
    ):
        for mode in ("first", "unbiased"):
            for design in cases.DESIGNS:
                results = cases.run(case, design, mode, cap, r, seed=args.seed, prompts=args.prompts)
                p, tv = cases.wald_pvalue(cases.returned_tokens(results), case[1], case[2])
                spent = sum(x.spent for x in results) / len(results)
                print(f"{label:<32} {mode:<9} {design:<11} {p:>8.1e} {tv:>6.3f} {spent:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
