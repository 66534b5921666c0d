"""Fused kernels agree with the torch reference; the dispatcher picks and falls back sanely.

Agreement rule (``qmc_sampler.kernels.EDGE_TOLERANCE``): a backend's token must be
the reference token, or a token whose reference interval lies within the
tolerance of u (u within float rounding of an interval edge). Interval starts and
widths must match the reference to the same tolerance.
"""

import pathlib

import numpy as np
import pytest
import torch

from qmc_sampler import inverse_cdf, process_logits
from qmc_sampler.kernels import EDGE_TOLERANCE, backend_for, fused_draw

cpp = pytest.mark.skipif(backend_for(torch.device("cpu")) != "cpp", reason="fused CPU kernel not built")


def reference_cdf(logits, t, k, p, m, order):
    probs = torch.softmax(process_logits(logits, t, k, p, m).double(), -1)
    if order == "sorted":
        probs, perm = torch.sort(probs, dim=-1, descending=True, stable=True)
    else:
        perm = torch.arange(probs.shape[1]).expand_as(probs)
    return torch.cumsum(probs, -1), perm


@cpp
@pytest.mark.parametrize("order", ["id", "sorted"])
@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_cpp_kernel_agrees_with_the_torch_reference(filter_setting, order, vocab, row_filters):
    temperature, top_k, top_p, min_p = filter_setting
    gen = torch.Generator().manual_seed(vocab + top_k)
    batch = 16
    logits = torch.randn(batch, vocab, generator=gen) * 4
    u = torch.rand(batch, dtype=torch.float64, generator=gen)
    args = row_filters(batch, temperature, top_k, top_p, min_p)
    assert_agrees_with_reference(logits, u, args, order)


def assert_agrees_with_reference(logits, u, args, order, min_same=0.9):
    """The kernel's token is the reference's (or u is within EDGE_TOLERANCE of an edge), and
    its interval start and width equal the reference's: any difference in the kept set
    (a token more or less in top-p) changes every width through the normaliser."""
    batch = logits.shape[0]
    ref = inverse_cdf(process_logits(logits, *args), u, order=order)
    got = fused_draw(logits, u, *args, order)
    cdf, perm = reference_cdf(logits, *args, order)
    for row in range(batch):
        if got.tokens[row] == ref.tokens[row]:
            continue
        pos = int((perm[row] == got.tokens[row]).nonzero()[0, 0])
        lo = float(cdf[row, pos - 1]) if pos else 0.0
        hi = float(cdf[row, pos])
        assert lo - EDGE_TOLERANCE <= float(u[row]) < hi + EDGE_TOLERANCE, (row, lo, hi, float(u[row]))
    same = got.tokens == ref.tokens
    np.testing.assert_allclose(got.starts[same], ref.starts[same], atol=EDGE_TOLERANCE)
    np.testing.assert_allclose(got.probs[same], ref.probs[same], atol=EDGE_TOLERANCE)
    assert same.float().mean() >= min_same


@cpp
@pytest.mark.parametrize(
    ("case", "vocab", "temperature", "min_p"),
    [
        ("ties", 1000, 1.0, 0.0),  # six distinct logits: the cut falls inside a tie group
        ("ties", 49152, 0.5, 0.02),
        ("flat", 49152, 2.0, 0.0),  # thousands of tokens kept
        ("peaked", 151936, 0.7, 0.0),
        ("one value", 4096, 1.0, 0.0),  # every logit equal
    ],
)
@pytest.mark.parametrize("order", ["id", "sorted"])
def test_cpp_top_p_without_sorting_keeps_exactly_vllms_set(case, vocab, temperature, min_p, order, cut_rows_factory):
    """The pivot search for the top-p cut (no sort) keeps the set vLLM's sort keeps,
    ties at the cut included (larger token ids first, as a stable ascending sort leaves
    them), for p from almost 0 (only the top tokens) to almost 1, one p per row."""
    gen = torch.Generator().manual_seed(vocab)
    batch = 48
    logits = cut_rows_factory(case, batch, vocab, gen)
    u = torch.rand(batch, dtype=torch.float64, generator=gen)
    top_p = torch.cat([torch.tensor([1e-4, 0.01]), torch.linspace(0.05, 0.999, batch - 2)])
    args = (torch.full((batch,), temperature), torch.zeros(batch, dtype=torch.long), top_p, torch.full((batch,), min_p))
    assert_agrees_with_reference(logits, u, args, order, min_same=0.95)


@cpp
@pytest.mark.parametrize(
    ("case", "vocab", "top_k", "top_p", "min_p"),
    [
        ("ties", 49152, 0, 0.9, 0.02),
        ("flat", 49152, 0, 0.5, 0.0),
        ("peaked", 151936, 0, 0.95, 0.0),
        ("flat", 5000, 0, 1.0, 0.0),
        ("flat", 49152, 50, 1.0, 0.0),
        ("ties", 49152, 40, 0.9, 0.0),
        ("flat", 49152, 1000, 1.0, 0.0),
        ("ties", 49152, 20000, 0.9, 0.0),
    ],
)
def test_a_row_alone_split_over_threads_is_drawn_as_in_a_batch(case, vocab, top_k, top_p, min_p, cut_rows_factory):
    """Fewer rows than threads: each row's passes are split over the threads; its token,
    interval start and width are bit-identical to one thread drawing it in a batch."""
    # torch._C's setter: an in-process vLLM CPU engine replaces torch.set_num_threads with a no-op.
    threads = torch.get_num_threads()
    torch._C.set_num_threads(max(2, threads))
    assert torch.get_num_threads() >= 2
    try:
        gen = torch.Generator().manual_seed(vocab)
        batch = 8
        logits = cut_rows_factory(case, batch, vocab, gen)
        u = torch.rand(batch, dtype=torch.float64, generator=gen)
        k = torch.full((batch,), top_k) if top_k else None
        args = (torch.full((batch,), 0.8), k, torch.full((batch,), top_p), torch.full((batch,), min_p))
        together = fused_draw(logits, u, *args, "id")
        for row in range(batch):
            one = (None if a is None else a[row : row + 1] for a in args)
            alone = fused_draw(logits[row : row + 1], u[row : row + 1], *one, "id")
            assert int(alone.tokens) == int(together.tokens[row]), row
            assert float(alone.starts) == float(together.starts[row]), row
            assert float(alone.probs) == float(together.probs[row]), row
    finally:
        torch._C.set_num_threads(threads)


def test_uniforms_at_the_extremes_pick_the_first_and_last_admissible_tokens():
    logits = torch.tensor([[float("-inf"), 1.0, 2.0, float("-inf"), 0.5, float("-inf")]])
    ones = torch.ones(1)
    first = fused_draw(logits, torch.tensor([0.0], dtype=torch.float64), ones, None, None, None, "id")
    last = fused_draw(logits, torch.tensor([1 - 2.0**-53], dtype=torch.float64), ones, None, None, None, "id")
    assert first.tokens.item() == 1 and last.tokens.item() == 4
    assert abs(last.starts.item() + last.probs.item() - 1.0) < 1e-9


@cpp
@pytest.mark.parametrize("top_k", [50, 300])  # from heaps, and by selection
def test_top_k_with_exactly_k_tokens_above_a_pivot(top_k):
    """k tokens at 10 and the rest at 0, T = 1: exactly k lie above every pivot of the kernel's
    selection bracket (1 to 12 T below the top), and the k kept are those k."""
    batch, vocab = 4, 4096
    logits = torch.zeros(batch, vocab)
    gen = torch.Generator().manual_seed(top_k)
    for row in range(batch):
        logits[row, torch.randperm(vocab, generator=gen)[:top_k]] = 10.0
    u = torch.rand(batch, dtype=torch.float64, generator=gen)
    args = (torch.ones(batch), torch.full((batch,), top_k), torch.ones(batch), torch.zeros(batch))
    assert_agrees_with_reference(logits, u, args, "id", min_same=1.0)
    assert torch.equal(fused_draw(logits, u, *args, "id").probs, torch.full((batch,), 1.0 / top_k, dtype=torch.float64))


@cpp
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_cpp_kernel_rejects_bad_rows_like_the_reference(bad):
    logits = torch.zeros(3, 5)
    logits[1] = bad
    with pytest.raises(ValueError, match="row 1 has NaN or no admissible token"):
        fused_draw(logits, torch.full((3,), 0.5, dtype=torch.float64), torch.ones(3), None, None, None, "id")


def test_forcing_a_backend(monkeypatch):
    monkeypatch.setenv("QMC_SAMPLER_BACKEND", "torch")
    assert backend_for(torch.device("cpu")) == "torch"
    monkeypatch.setenv("QMC_SAMPLER_BACKEND", "fast")
    with pytest.raises(
        ValueError, match=r"QMC_SAMPLER_BACKEND='fast' is not a backend; use one of \['cpp', 'triton', 'torch'\]"
    ):
        backend_for(torch.device("cpu"))
    monkeypatch.setenv("QMC_SAMPLER_BACKEND", "cpp")
    with pytest.raises(ValueError, match="unavailable for meta logits"):
        backend_for(torch.device("meta"))


def test_every_backend_falls_back_to_torch_off_the_cpu():
    monkeypatch_free = backend_for(torch.device("meta"))
    assert monkeypatch_free == "torch"


def test_the_backend_is_decided_once_per_device_type_not_per_step(monkeypatch):
    """Probing Triton and CUDA costs tens of microseconds: a decoding step must not pay it."""
    import qmc_sampler.triton_kernels

    monkeypatch.delenv("QMC_SAMPLER_BACKEND", raising=False)
    first = backend_for(torch.device("cuda"))

    def probed_again() -> bool:
        raise AssertionError("triton_available() was called again for the same device type and settings")

    monkeypatch.setattr(qmc_sampler.triton_kernels, "triton_available", probed_again)
    assert backend_for(torch.device("cuda")) == first
    monkeypatch.setenv("QMC_SAMPLER_BACKEND", "torch")  # another setting decides afresh
    assert backend_for(torch.device("cuda")) == "torch"


@cpp
def test_the_kernel_is_used_only_under_the_torch_it_was_built_against(monkeypatch):
    # A kernel built in place by another venv (another torch's C++ ABI) could fail or crash at its
    # first call: it is refused at load, loudly, and the pure-torch path serves.
    from qmc_sampler import _C, kernels

    assert _C.built_with_torch == torch.__version__
    monkeypatch.setattr(_C, "built_with_torch", "2.11.0+cpu")
    kernels._cpp_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"built against torch 2\.11\.0\+cpu, this is torch"):
            assert kernels._cpp_kernel() is None
    finally:
        monkeypatch.undo()
        kernels._cpp_kernel.cache_clear()
    assert kernels._cpp_kernel() is _C


@cpp
@pytest.mark.parametrize("record", ["2.11.0+cpu\n", None, b"\xff\xfe"], ids=["another-torch", "no-record", "not-text"])
def test_the_kernel_is_refused_by_its_record_before_its_library_is_loaded(monkeypatch, tmp_path, record):
    # setup.py writes the torch it built against beside the .so; a record naming another torch, or none,
    # refuses the kernel before the import that would load another torch's C++ ABI.
    import importlib.util
    import shutil
    import sys

    from qmc_sampler import kernels

    real = importlib.util.find_spec("qmc_sampler._C")
    assert (pathlib.Path(real.origin).with_name(kernels.KERNEL_RECORD)).read_text().strip() == torch.__version__
    fake_origin = tmp_path / pathlib.Path(real.origin).name
    shutil.copy(real.origin, fake_origin)
    if isinstance(record, bytes):
        fake_origin.with_name(kernels.KERNEL_RECORD).write_bytes(record)
    elif record is not None:
        fake_origin.with_name(kernels.KERNEL_RECORD).write_text(record)
    fake = importlib.util.spec_from_file_location("qmc_sampler._C", fake_origin)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "qmc_sampler._C" else None)
    monkeypatch.delitem(sys.modules, "qmc_sampler._C", raising=False)
    monkeypatch.delattr("qmc_sampler._C", raising=False)
    kernels._cpp_kernel.cache_clear()
    try:
        match = {str: r"built against torch 2\.11\.0\+cpu \(", bytes: r"cannot be read \(.*codec"}.get(
            type(record), r"is missing, so the torch it was built"
        )
        with pytest.warns(UserWarning, match=match):
            assert kernels._cpp_kernel() is None
        assert "qmc_sampler._C" not in sys.modules  # refused before `from qmc_sampler import _C`
    finally:
        monkeypatch.undo()
        kernels._cpp_kernel.cache_clear()
    assert kernels._cpp_kernel() is not None


@cpp
def test_pure_torch_switches_this_thread_only():
    # The plugin draws a step again on the pure-torch path when a fused backend fails; the engine's
    # other threads (and the environment) keep their backend.
    import threading

    from qmc_sampler import kernels

    seen = []
    with kernels.pure_torch():
        other = threading.Thread(target=lambda: seen.append(backend_for(torch.device("cpu"))))
        other.start()
        other.join()
        assert backend_for(torch.device("cpu")) == "torch"
    assert seen == ["cpp"] and backend_for(torch.device("cpu")) == "cpp"
