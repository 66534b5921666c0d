"""The processed distribution matches vLLM's definitions (temperature, min-p, top-k, top-p)."""

import numpy as np
import pytest
import torch

from qmc_sampler import process_logits


def test_matches_an_independent_statement_of_vllms_rules(processed_reference, filter_setting):
    temperature, top_k, top_p, min_p = filter_setting
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 2
    out = process_logits(
        logits,
        torch.full((6,), temperature),
        torch.full((6,), top_k),
        torch.full((6,), top_p),
        torch.full((6,), min_p),
    )
    probs = torch.softmax(out.double(), dim=-1).numpy()
    for row in range(6):
        expected = processed_reference(logits[row].numpy(), temperature, top_k, top_p, min_p)
        np.testing.assert_allclose(probs[row], expected, atol=1e-6)


def test_rows_keep_their_own_parameters():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(1))
    out = process_logits(logits, torch.ones(3), torch.tensor([0, 3, 30]), torch.tensor([1.0, 1.0, 0.5]), None)
    finite = torch.isfinite(out).sum(dim=-1).tolist()
    assert finite[0] == 30 and finite[1] == 3 and finite[2] < 30


def test_top_k_alone_keeps_each_rows_own_k():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    out = process_logits(logits, torch.ones(4), torch.tensor([0, 3, 30, 7]), None, None)
    assert torch.isfinite(out).sum(dim=-1).tolist() == [30, 3, 30, 7]
    kept = torch.isfinite(out[3])
    assert logits[3][kept].min() >= logits[3][~kept].max()  # the 7 largest


def test_ties_at_the_kth_logit_are_kept_like_vllm():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5]])
    out = process_logits(logits, torch.ones(1), torch.tensor([2]), None, None)
    assert torch.isfinite(out).tolist() == [[False, True, True, False]]


def test_input_is_not_modified():
    logits = torch.randn(2, 10)
    before = logits.clone()
    process_logits(
        logits, torch.full((2,), 0.5), torch.tensor([3, 0]), torch.tensor([0.5, 1.0]), torch.tensor([0.1, 0])
    )
    torch.testing.assert_close(logits, before)


@pytest.mark.parametrize("seed", range(5))
def test_equals_vllms_own_top_k_top_p_and_min_p(seed):
    # Imported here: vLLM takes ~10 s to import, which the other tests (and the mutants that
    # run them alone) need not pay.
    vllm_ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler", reason="vLLM not installed")
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 8, 500
    logits = torch.randn(batch, vocab, generator=gen) * 3
    temperature = torch.rand(batch, generator=gen) + 0.5
    k = torch.randint(1, vocab + 1, (batch,), generator=gen)
    p = torch.rand(batch, generator=gen) * 0.9 + 0.1
    min_p = torch.rand(batch, generator=gen) * 0.05
    ours = process_logits(logits, temperature, k, p, min_p)
    # vLLM's own pipeline: temperature, MinPLogitsProcessor.apply's rule, apply_top_k_top_p_pytorch.
    theirs = logits / temperature.unsqueeze(1)
    probs = torch.softmax(theirs, dim=-1)
    theirs = theirs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1), float("-inf"))
    theirs = vllm_ops.apply_top_k_top_p_pytorch(theirs.clone(), k.clone(), p.clone())
    torch.testing.assert_close(torch.isfinite(ours), torch.isfinite(theirs))
    torch.testing.assert_close(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


def kept_by_the_sorted_rule(logits, top_p):
    """vLLM's top-p rule stated with a sort (stable: ties in id order), in float64: a token is
    masked when the cumulative probability up to it in ascending order is <= 1 - p."""
    ordered, index = logits.double().sort(dim=-1, stable=True)
    masked = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1) <= 1 - top_p.double().unsqueeze(1)
    masked[:, -1] = False
    return torch.zeros_like(masked).scatter_(-1, index, ~masked)


@pytest.mark.parametrize("case", ["ties", "one value", "flat", "peaked", "masked"])
def test_top_p_without_sorting_keeps_the_sorted_rules_set_ties_included(case):
    # Six distinct logits (ties): the cut falls inside a tie group, where the larger ids are
    # kept first; p is continuous, so no row sits exactly on a rounding boundary.
    gen = torch.Generator().manual_seed(7)
    batch, vocab = 64, 3000
    if case == "ties":
        logits = torch.randint(0, 6, (batch, vocab), generator=gen).float() / 2
    elif case == "one value":
        logits = torch.full((batch, vocab), -0.75)
    else:
        logits = torch.randn(batch, vocab, generator=gen) * (0.5 if case != "peaked" else 4.0)
    if case == "masked":
        logits = logits.masked_fill(logits < 0.2, float("-inf"))
        logits[:, 5] = 3.0
    top_p = torch.rand(batch, generator=gen).clamp(1e-4, 0.999)
    top_p[:4] = torch.tensor([1e-4, 0.003, 0.9993, 1.0])
    out = process_logits(logits, torch.ones(batch), None, top_p, None)
    kept = torch.isfinite(out)
    expected = kept_by_the_sorted_rule(logits, top_p)
    assert torch.equal(kept, expected), (kept != expected).any(-1).nonzero().flatten().tolist()
    assert kept.any(-1).all() and torch.equal(out[kept], logits[kept])


def tie_heavy_rows(seed: int, batch: int = 48, vocab: int = 2500) -> torch.Tensor:
    """Rows with ties at every value, -inf tokens, negative and positive values, one constant row."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-6, 6, (batch, vocab), generator=gen).float() / 2
    logits[: batch // 2] = torch.randn(batch // 2, vocab, generator=gen) * 3
    logits = logits.masked_fill(torch.rand(batch, vocab, generator=gen) < 0.3, float("-inf"))
    logits[:, 0] = 0.0  # a finite token in every row
    logits[-1] = -1.5
    return logits


@pytest.mark.parametrize("seed", range(3))
def test_the_device_paths_top_k_equals_the_selection_on_the_cpu(seed):
    # On an accelerator top-k is a radix search (nothing read back), on the CPU torch.topk.
    from qmc_sampler.processing import _top_k_by_search, _top_k_by_selection

    logits = tie_heavy_rows(seed)
    batch, vocab = logits.shape
    gen = torch.Generator().manual_seed(100 + seed)
    top_k = torch.randint(1, 60, (batch,), generator=gen)
    top_k[:4] = torch.tensor([0, vocab, vocab - 1, 1])  # off, off, all but one, the largest (ties kept)
    by_search = torch.isfinite(_top_k_by_search(logits, top_k))
    assert torch.equal(by_search, torch.isfinite(_top_k_by_selection(logits, top_k)))
    assert torch.equal(by_search[:2], torch.isfinite(logits[:2]))


def test_the_device_paths_filters_read_nothing_back(host_reads):
    # On a GPU each read waits for the device: the per-step path must not make any.
    from qmc_sampler import processing

    logits = tie_heavy_rows(0)
    batch = logits.shape[0]
    for name in ("_top_k_by_search", "_top_p_by_search"):
        host_reads.watch(processing, name)
    top_p = processing._top_p_by_search(logits, torch.linspace(0.05, 1.0, batch))
    top_k = processing._top_k_by_search(logits, torch.arange(batch))
    assert host_reads.reads == [] and host_reads.steps == [batch, batch]
    assert torch.isfinite(top_p).any(-1).all() and torch.isfinite(top_k).any(-1).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_every_filter_runs_without_a_read_and_keeps_the_cpus_set(host_reads):
    from qmc_sampler import processing

    logits = tie_heavy_rows(1)
    batch = logits.shape[0]
    params = (torch.full((batch,), 0.9), torch.arange(batch) % 40, torch.linspace(0.1, 1.0, batch),
              torch.linspace(0.0, 0.2, batch))  # fmt: skip
    on_cpu = torch.isfinite(process_logits(logits, *params))
    host_reads.watch(processing, "process_logits")
    on_gpu = processing.process_logits(logits.cuda(), *(t.cuda() for t in params))
    assert host_reads.reads == []
    assert torch.equal(torch.isfinite(on_gpu).cpu(), on_cpu)
