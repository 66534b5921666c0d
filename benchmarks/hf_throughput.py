"""transformers' ``generate`` throughput with correlated groups (``QMCGenerate``) vs plain sampling.

A randomly initialised model of a real small architecture — Llama-3.2-1B's configuration,
written out here, in bf16; nothing is downloaded — and the same prompts (random token ids),
``num_return_sequences = n`` and the same lengths (``min_new_tokens = max_new_tokens``, so
no row stops early); runs alternate between

* ``plain``   — transformers' own sampling (its warpers, then ``torch.multinomial``), and
* ``lattice`` — the same call with ``custom_generate=QMCGenerate("lattice")``: each prompt's
  n rows one lattice group, every token drawn by the forcer after all of transformers' warpers,

for several rounds (the order flips each round), and the script prints each run's output
tokens/s and the ratio of the medians (lattice / plain; 1.0 = no overhead).

    python benchmarks/hf_throughput.py [--device cuda] [--prompts 8] [--n 16] [--max-new-tokens 128]
                                       [--rounds 3] [--tiny]

``--tiny``: a 2-layer model of the same family in float32, 2 prompts, n = 4, 8 tokens (checks
that it runs, e.g. on a CPU). Each run is timed to the end of its kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

#: meta-llama/Llama-3.2-1B's config.json, as its fields are named in transformers 5.
LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    },
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
)

TINY = LLAMA_3_2_1B | dict(
    vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def build_model(config_fields: dict, dtype: torch.dtype, device: torch.device):
    """A randomly initialised ``LlamaForCausalLM`` made directly on ``device`` (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**config_fields)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="2-layer float32 model, 2 prompts, n = 4, 8 tokens")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    if args.tiny:
        args.prompts, args.n, args.max_new_tokens = 2, 4, 8
    from qmc_sampler.hf import QMCGenerate

    from qmc_sampler.cpu_defaults import describe_cpu

    fields, dtype = (TINY, torch.float32) if args.tiny else (LLAMA_3_2_1B, torch.bfloat16)
    start = time.perf_counter()
    model = build_model(fields, dtype, device)
    params = sum(t.numel() for t in model.parameters())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else describe_cpu()
    print(
        f"model: random {'tiny Llama' if args.tiny else 'Llama-3.2-1B'} ({params / 1e9:.2f} B parameters, {dtype}), "
        f"built in {time.perf_counter() - start:.1f} s on {where}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, fields["vocab_size"], (args.prompts, args.prompt_len), generator=gen).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(design: QMCGenerate | None, new_tokens: int) -> float:
        extra = {"custom_generate": design} if design is not None else {}
        sync()
        begin = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                top_k=50, top_p=1.0, num_return_sequences=args.n, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, pad_token_id=0, **extra,
            )  # fmt: skip
        sync()
        elapsed = time.perf_counter() - begin
        assert out.shape == (args.prompts * args.n, args.prompt_len + new_tokens), out.shape
        if design is not None:
            assert [len(g.rows) for g in design.last_groups] == [args.n] * args.prompts, design.last_groups
        return out.shape[0] * new_tokens / elapsed

    lattice = QMCGenerate("lattice", seed=0)
    run(None, min(8, args.max_new_tokens))  # warm-up: allocations, kernel compilation
    run(lattice, min(8, args.max_new_tokens))
    results: dict[str, list[float]] = {"plain": [], "lattice": []}
    for r in range(args.rounds):
        order = ("plain", "lattice") if r % 2 == 0 else ("lattice", "plain")
        for name in order:
            results[name].append(run(lattice if name == "lattice" else None, args.max_new_tokens))
        print(
            f"round {r + 1}: plain {results['plain'][-1]:,.0f} tok/s, lattice {results['lattice'][-1]:,.0f} tok/s "
            f"({order[0]} first)",
            flush=True,
        )
    plain, correlated = statistics.median(results["plain"]), statistics.median(results["lattice"])
    print(
        f"lattice/plain tokens/s ratio = {correlated / plain:.3f} (medians over {args.rounds} rounds: plain "
        f"{plain:,.0f}, lattice {correlated:,.0f} tok/s; {args.prompts} prompts x {args.n} sequences x "
        f"{args.max_new_tokens} new tokens, {device.type})"
    )


if __name__ == "__main__":
    main()
