"""One GRPOTrainer step with vLLM generating correlated rollouts. Needs a CUDA GPU (CI has none).

Colocate mode: TRL repeats each prompt ``num_generations`` times as n = 1
requests to an in-process ``vllm.LLM`` (``logprobs_mode=processed_logprobs``);
with ``QMC_SAMPLER=lattice`` the plugin groups the repeats. Runs the GPU build of
vLLM (the ``gpu`` extra) with TRL 1.16.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("a GRPOTrainer step with vLLM needs a CUDA GPU", allow_module_level=True)
trl = pytest.importorskip("trl")
pytest.importorskip("vllm", reason="vLLM not installed")

pytestmark = [pytest.mark.vllm, pytest.mark.cuda]


def test_a_grpo_step_with_correlated_rollouts(tiny_model_dir, tmp_path, monkeypatch):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("QMC_SAMPLER", "lattice")
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, os.environ.get(name, value))
    monkeypatch.setenv("MASTER_PORT", os.environ.get("MASTER_PORT", "29533"))
    data = Dataset.from_dict({"prompt": ["the quick brown", "pack my box", "one two three", "sphinx of"] * 4})

    def reward_length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    config = GRPOConfig(
        output_dir=str(tmp_path),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.2,
        vllm_max_model_length=256,
        num_generations=8,
        per_device_train_batch_size=8,
        max_completion_length=8,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        bf16=False,
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward_length, args=config, train_dataset=data)
    result = trainer.train()
    print("GRPO step:", result, trainer.state.log_history)
    stats = trainer.vllm_generation.llm.collective_rpc("qmc_sampler_stats")[0]
    print("plugin stats in the colocated engine:", stats)
    assert result.global_step == 1
    assert stats["auto_members"] >= 8 and stats["auto_groups"] >= 1  # the repeats became groups
