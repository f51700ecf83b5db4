"""Sampling speed with and without the KV cache on the GPT-2 124M shape (random weights).

    python benchmarks/sampling.py [--new-tokens 256] [--prompt-tokens 16] [--device cpu]

Prints tokens/s for each and the ratio; greedy decoding, batch 1, the same prompt, fp32.
"""

from __future__ import annotations

import argparse
import time

import torch

from gptforge.model.generate import generate
from gptforge.model.gpt import GPT, MODEL_PRESETS, GPTConfig
from gptforge.runtime.allocator import keep_freed_memory
from gptforge.runtime.device import resolve_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--preset", default="gpt2", choices=sorted(MODEL_PRESETS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weight dtype")
    args = p.parse_args()
    keep_freed_memory()
    device = resolve_device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL_PRESETS[args.preset])).to(device, getattr(torch, args.dtype)).eval()
    prompt = torch.randint(0, 50257, (args.prompt_tokens,)).tolist()
    generate(model, prompt, 8, temperature=0)  # warm-up
    rates = {}
    for use_cache in (True, False):
        t = time.perf_counter()
        out = generate(model, prompt, args.new_tokens, temperature=0, use_cache=use_cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates[use_cache] = len(out[0]) / (time.perf_counter() - t)
        print(f"{'with' if use_cache else 'without'} KV cache: {rates[use_cache]:8.1f} tokens/s")
    print(
        f"{args.preset} ({args.dtype}) on {device}, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens: "
        f"cache speed-up {rates[True] / rates[False]:.1f}x"
    )


if __name__ == "__main__":
    main()
