"""``synced_gpus`` and ``streamer`` reach HF's sampling loop through ``QMCGenerate``; one generator
serves concurrent calls with distinct seeds; member order of merged groups; argument errors.

transformers 5 does not forward ``synced_gpus`` or ``streamer`` to a ``custom_generate``
callable. ``synced_gpus`` is checked for real: a gloo process group of world size 1 is
initialised, and HF's loop then all-reduces its "this peer finished" flag at every step
(``GenerationMixin._has_unfinished_sequences``), which is what keeps ZeRO-3/FSDP ranks
stepping together; the spy counts those all-reduces.
"""

import importlib
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
from qmc_sampler.hf import QMCForcer, QMCGenerate  # noqa: E402
from qmc_sampler.hf.forcer import ForcerStats, member_order  # noqa: E402
from qmc_sampler.hf.rows import prompt_keys  # noqa: E402

T = 1.5
PROMPT = torch.tensor([[356, 295, 354, 83]])  # "the quick brown" in the tiny BPE


def generate(model, generator, new_tokens=3, g=4, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids=PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=True,
                              num_return_sequences=g, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              temperature=T, pad_token_id=0, custom_generate=generator, **kwargs)  # fmt: skip


@pytest.fixture
def all_reduces(tmp_path, monkeypatch):
    """A gloo process group of world size 1, and a list that grows by one per ``all_reduce``."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    calls = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append(tensor.clone())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    try:
        yield calls
    finally:
        dist.destroy_process_group()


def test_synced_gpus_given_to_generate_reaches_hfs_sampling_loop(hf_model, all_reduces):
    synced = generate(hf_model, QMCGenerate("lattice", seed=1), synced_gpus=True)
    assert len(all_reduces) >= 3  # one per step: the ranks step together
    all_reduces.clear()
    plain = generate(hf_model, QMCGenerate("lattice", seed=1), synced_gpus=False)
    assert all_reduces == []
    assert torch.equal(synced, plain)  # syncing changes no draw


def test_a_generators_synced_gpus_is_the_default_and_a_calls_own_value_wins(hf_model, all_reduces):
    generator = QMCGenerate("lattice", seed=2, synced_gpus=True)
    generate(hf_model, generator)
    assert len(all_reduces) >= 3
    all_reduces.clear()
    generate(hf_model, generator, synced_gpus=False)
    assert all_reduces == []


def test_transformers_rule_sets_synced_gpus_under_zero3_with_several_processes(hf_model, all_reduces, monkeypatch):
    import transformers.integrations.deepspeed as deepspeed

    monkeypatch.setattr(deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    monkeypatch.setattr(importlib.import_module("qmc_sampler.hf.generate"), "_world_size", lambda: 2, raising=False)
    generate(hf_model, QMCGenerate("lattice", seed=3))
    assert len(all_reduces) >= 3


class Recorder(transformers.generation.streamers.BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_a_streamer_given_to_generate_gets_every_token_and_the_end(hf_model):
    streamer = Recorder()
    out = generate(hf_model, QMCGenerate("lattice", seed=4), new_tokens=3, g=1, streamer=streamer)
    assert streamer.ended  # a TextIteratorStreamer's reader would otherwise wait forever
    assert streamer.puts[0] == PROMPT[0].tolist()
    assert [t for put in streamer.puts[1:] for t in put] == out[0, PROMPT.shape[1] :].tolist()


def test_a_streamer_reaches_a_generator_called_from_the_users_own_custom_generate(hf_model):
    lattice, streamer = QMCGenerate("lattice", seed=4), Recorder()

    def my_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        return lattice(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)

    out = generate(hf_model, my_generate, new_tokens=3, g=1, streamer=streamer)
    assert streamer.ended and [t for put in streamer.puts[1:] for t in put] == out[0, PROMPT.shape[1] :].tolist()


def test_concurrent_calls_of_one_generator_get_distinct_call_seeds(hf_model, monkeypatch):
    # Reference: calls 0 and 1 of a generator seeded 5, one after the other.
    reference = sorted(generate(hf_model, generator).tolist() for generator in [QMCGenerate("lattice", seed=5)] * 2)
    assert reference[0] != reference[1]
    # Two threads share one generator; each waits for the other before building its forcer, so both calls
    # are in flight between being issued a seed and using it.
    module = importlib.import_module("qmc_sampler.hf.generate")
    barrier = threading.Barrier(2, timeout=120)
    real = module.QMCForcer

    def forcer_once_both_calls_are_in_flight(*args, **kwargs):
        barrier.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "QMCForcer", forcer_once_both_calls_are_in_flight)
    shared = QMCGenerate("lattice", seed=5)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: generate(hf_model, shared).tolist(), range(2)))
    assert sorted(outs) == reference  # calls 0 and 1, each once
    assert shared.stats.calls == 2


@pytest.mark.parametrize(
    ("method", "blocks", "expected"),
    [
        ("lattice", [[0, 1, 2], [3, 4, 5]], [0, 3, 1, 4, 2, 5]),  # i/6 order: round-robin
        ("arithmetic", [[0, 1, 2], [3, 4, 5]], [0, 3, 1, 4, 2, 5]),
        ("lattice", [[0, 1, 2, 3], [4, 5, 6, 7]], [0, 1, 2, 3, 4, 5, 6, 7]),  # radical inverse: aligned blocks
        ("sobol", [[0, 1], [2, 3]], [0, 1, 2, 3]),
        ("antithetic", [[0, 1], [2, 3]], [0, 1, 2, 3]),  # pairs stay in one copy
        ("lattice", [[0], [1], [2]], [0, 1, 2]),  # TRL: one row per block
        ("lattice", [[0, 1, 2]], [0, 1, 2]),
    ],
)
def test_member_order_spreads_each_copy_over_the_design(method, blocks, expected):
    assert member_order(method, blocks) == expected


def test_member_order_gives_each_copy_a_shifted_sub_lattice():
    from qmc_sampler.designs import get_design

    for n, k in [(6, 2), (12, 3), (10, 5), (16, 2), (16, 4)]:
        g = n // k
        rows = member_order("lattice", [range(b * g, (b + 1) * g) for b in range(k)])
        codes = get_design("lattice").start_codes(np.full(n, 7, dtype=np.uint64), np.full(n, n), np.arange(n))
        for b in range(k):
            copy = np.sort(codes[[rows.index(r) for r in range(b * g, (b + 1) * g)]])
            gaps = np.diff(np.append(copy, copy[0] + 1.0))
            assert np.allclose(gaps, 1.0 / g), (n, k, b)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="synced_gpus='yes' is not a bool"):
        QMCGenerate("lattice", synced_gpus="yes")
    with pytest.raises(ValueError, match="copies=0 is not a row count"):
        prompt_keys(torch.zeros(4, 2, dtype=torch.long), {}, copies=0)
    with pytest.raises(ValueError, match="copies=3 does not divide the 4 rows"):
        prompt_keys(torch.zeros(4, 2, dtype=torch.long), {}, copies=3)
    with pytest.raises(ValueError, match=r"\['calls_made'\] are not ForcerStats counters"):
        ForcerStats().add(calls_made=1)
    forcer = QMCForcer("lattice", 0, prompt_keys=[b"a", b"b"], copies=3)
    with pytest.raises(ValueError, match="prompt_keys has 2 keys and copies=3, which make 6 rows, but the batch has 4"):
        forcer(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 8))
