"""No host syncs on a CUDA GPU (``make gpu-check``): the kernel step, the vLLM plugin's device carry
(its member registry, no vLLM needed) and the HF forcer, each over a whole group, run under
``torch.cuda.set_sync_debug_mode("error")``: any wait for the device — a read back (``tolist``,
``item``, ``.cpu()``, a tensor's truth value), ``nonzero`` or a boolean mask's index, an upload
from pageable host memory — raises there, and the test names the step it came from.

Skipped without CUDA. ``QMC_GPU_CHECK_DEVICE=cpu`` (``gpu_check.sh``'s dry run) runs the same calls
on the CPU, where nothing syncs: it only checks that they run, and warns with the host reads it
records (``tolist``, ``item``, ``cpu``, ``numpy``, truth values …), a hint of a GPU run's outcome:
each is a sync on a GPU where the GPU takes the same path (the torch path's filters read on the CPU
only), and an upload from pageable memory, a sync on a GPU, does not show. The HF forcer's case
fails on a recorded read there too.

The HF forcer places its rows at the first step of a ``generate`` call (grouping is a host
decision, and its carried state moves to the device then): that step runs unwatched, every later
one is held to the rule.
"""

import contextlib
import os
import warnings

import numpy as np
import pytest
import torch

from qmc_sampler import kernels

#: Where these tests run: CUDA (skipped without it), or the CPU for gpu_check.sh's dry run.
DEVICE = torch.device(os.environ.get("QMC_GPU_CHECK_DEVICE", "cuda"))
ON_GPU = DEVICE.type == "cuda"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

G = 16  # one group of 16 members
STEPS = 8
VOCAB = 32768 if ON_GPU else 1200


@contextlib.contextmanager
def no_host_sync():
    """On a GPU: every synchronising call raises (``set_sync_debug_mode("error")``). Elsewhere: nothing."""
    if not ON_GPU:
        yield
        return
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class Reads:
    """Every way a tensor's value reaches Python while :attr:`on` (on the CPU stand-in: what would
    sync on a GPU, uploads aside)."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.on = False
        self.seen: list[str] = []
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._recorder(name, getattr(torch.Tensor, name)))

    def _recorder(self, name, original):
        def read(tensor, *args, **kwargs):
            if self.on:
                self.seen.append(name)
            return original(tensor, *args, **kwargs)

        return read

    def report(self, what: str) -> None:
        """Warn with the reads recorded (on the CPU stand-in; on a GPU the sync mode has spoken)."""
        if not ON_GPU and self.seen:
            counts = {name: self.seen.count(name) for name in dict.fromkeys(self.seen)}
            warnings.warn(
                f"{what}: {STEPS} steps, host reads on the CPU stand-in: {counts} (each a sync on a GPU "
                "where the GPU takes the same path)",
                stacklevel=2,
            )


@pytest.fixture
def reads(monkeypatch) -> Reads:
    return Reads(monkeypatch)


def run_steps(step, reads: Reads, steps: int = STEPS, watch_from: int = 0) -> None:
    """``step(t)`` for each step, from step ``watch_from`` on under :func:`no_host_sync` (the steps
    before it run unwatched and unrecorded); a sync fails the test, naming the step."""
    for t in range(steps):
        if t < watch_from:
            step(t)
            continue
        reads.on = True
        try:
            with no_host_sync():
                step(t)
        except RuntimeError as e:
            if "synchroniz" not in str(e):
                raise
            pytest.fail(f"step {t} of {steps} waited for the device: {e}")
        finally:
            reads.on = False


def next_logits(table: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The next step's logits of every row, chosen on the device by the row's last token."""
    return table[last % table.shape[0]]


def toy_table(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(64, VOCAB, generator=gen) * 0.5 - 2
    table[:, :40] = torch.randn(64, 40, generator=gen) * 1.5  # most of the mass on 40 tokens
    return table.to(DEVICE)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernel():
    """The Triton kernel compiled and the backend chosen before any sync is watched (a test run alone too)."""
    logits = toy_table(0)[:G]
    u = torch.full((G,), 0.5, dtype=torch.float64, device=DEVICE)
    kernels.fused_draw(logits, u, torch.ones(G, device=DEVICE), None, None, None, "id", check=False)
    if ON_GPU:
        torch.cuda.synchronize()


@pytest.mark.parametrize("order", ["id", "sorted"])
@pytest.mark.parametrize("filters", ["off", "top-k, top-p and min-p"])
def test_the_kernel_step_draws_a_whole_group_without_a_sync(reads, order, filters):
    # The core's draw with every operand on the device and no bad-row check (check=False: a bad
    # row's token is -1): the Triton kernel ("id"), the torch path ("sorted").
    table = toy_table(1)
    u = torch.rand(G, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    temperature = torch.full((G,), 0.9, device=DEVICE)
    on = filters != "off"
    k, p, mp = (torch.full((G,), v, device=DEVICE) if on else None for v in (50, 0.9, 0.02))
    last = torch.zeros(G, dtype=torch.int64, device=DEVICE)
    kernels.fused_draw(next_logits(table, last), u, temperature, k, p, mp, order, check=False)  # compiles, picks
    drawn = []

    def step(t: int) -> None:
        nonlocal last
        draw = kernels.fused_draw(next_logits(table, last), (u + t * 0.618) % 1.0, temperature, k, p, mp, order,
                                  check=False)  # fmt: skip
        last = draw.tokens
        drawn.append(draw.tokens)

    run_steps(step, reads)
    assert all((t >= 0).all() for t in drawn)
    reads.report(f"the kernel step ({order}, filters {filters})")


def test_the_plugins_device_carry_draws_a_whole_group_without_a_sync(reads):
    # The vLLM plugin's draw cycle without vLLM: a lattice group's members admitted, then each step
    # drawn, and accepted as the engine reports it (the token only the device knows, as under MRV2).
    from qmc_sampler.kernels import upload
    from qmc_sampler.members import PER_REQUEST, GroupArgs, MemberRegistry, RowSampling

    registry = MemberRegistry()
    request = GroupArgs(PER_REQUEST, "lattice", "id", 5, G, "gpu-check:group")
    plain = RowSampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    members = [registry.admit(request, plain, [1, 2, 3], [], identity=i) for i in range(G)]
    registry.pool.to(DEVICE)  # the pool moves to the logits' device once, at the first draw
    slots = upload(np.array([m.slot for m in members], dtype=np.int64), DEVICE)
    temperature = torch.ones(G, device=DEVICE)
    table = toy_table(3)
    last = torch.zeros(G, dtype=torch.int64, device=DEVICE)
    drawn = []

    def step(t: int) -> None:
        nonlocal last
        draw = registry.draw(next_logits(table, last), members, temperature, None, None, None, slots)
        for m in members:
            registry.sync(m, t + 1, None)  # accepted; the token is the device's
        last = draw.tokens
        drawn.append(draw.tokens)

    run_steps(step, reads)
    first = drawn[0].cpu().numpy()
    assert (torch.stack(drawn) >= 0).all()
    q = torch.softmax(table[0].double(), -1).cpu().numpy()
    counts = np.bincount(first, minlength=VOCAB)
    assert np.all((counts == np.floor(G * q)) | (counts == np.ceil(G * q)))  # one balanced lattice group
    reads.report("the plugin's device carry")


def test_the_hf_forcer_draws_a_whole_group_without_a_sync(reads):
    # The forcer as QMCGenerate runs it (num_return_sequences=G: one prompt, one group), in a
    # stand-in for transformers' _sample loop that itself never waits (transformers' own loop
    # checks for finished rows on the host every step): scores on the device, the forced token
    # taken on the device. Every step after the first (placement) is watched; the call reads the
    # device once when it ends (first tokens, rows left to transformers), outside the steps.
    transformers = pytest.importorskip("transformers")
    from qmc_sampler.hf import QMCGenerate

    table = toy_table(4)
    prompt = torch.tensor([[5, 6, 7, 8]], device=DEVICE).expand(G, 4).contiguous()
    config = transformers.GenerationConfig(do_sample=True, num_return_sequences=G, max_new_tokens=STEPS)
    failures = []

    class Loop(torch.nn.Module):
        """Stands in for the model: ``_sample`` runs the logits processors, each step under no_host_sync."""

        def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
            ids = input_ids

            def step(t: int) -> None:
                nonlocal ids
                scores = logits_processor(ids, next_logits(table, ids[:, -1]))
                ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)

            try:
                run_steps(step, reads, watch_from=1)
            except BaseException as e:  # pytest.fail: re-raised below, outside transformers' call
                failures.append(e)
                raise
            return ids

    generator = QMCGenerate("lattice", seed=7)
    out = generator(Loop(), prompt, transformers.LogitsProcessorList(), transformers.StoppingCriteriaList(), config)
    assert not failures
    assert out.shape == (G, 4 + STEPS)
    assert [len(g.rows) for g in generator.last_groups] == [G]
    q = torch.softmax(table[8].double(), -1).cpu().numpy()
    counts = np.bincount(out[:, 4].cpu().numpy(), minlength=VOCAB)
    assert np.all((counts == np.floor(G * q)) | (counts == np.ceil(G * q)))  # one balanced lattice group
    (group,) = generator.last_groups
    assert list(group.first_tokens) == out[list(group.rows), 4].tolist()  # read when the call ended
    assert generator.stats.unsampleable == 0
    # On the CPU stand-in a read in a watched step fails too (on a GPU the sync mode has spoken).
    assert ON_GPU or not reads.seen, f"steps after placement read the device back: {reads.seen}"
