"""Issue 37 item 3's first candidate, measured before it is built: the trainer's step (built as `gptforge bench`
builds it) with the blocks' linear layers in torchao's float8 training against the same step in bf16, timed step by
step in turn on the same random batches, with both losses side by side. torchao must be importable (carry its wheel
to a GPU machine); lm_head stays bf16 (tied to the embedding, and fused with the loss).

    python benchmarks/fp8_probe.py --config gpt2-124m [--recipe tensorwise] [--steps 5] [--warmup 3] [--json OUT]
    python benchmarks/fp8_probe.py --config tiny --set train.device=cpu --emulate   # the code path, on a CPU
"""

from __future__ import annotations

import argparse
import json

import torch

import gptforge.train.setup as setup
from gptforge.bench import _step, _sync, _time_interleaved
from gptforge.config import load_config
from gptforge.runtime.device import resolve_device
from gptforge.runtime.distributed import SINGLE


def build_pair(cfg, device: torch.device, recipe: str, emulate: bool, only: str):
    """The baseline's setup and the float8 one's, from the same seed: the same initial weights."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    baseline = setup.build(cfg, SINGLE, device)
    float8 = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        float8 = Float8LinearConfig(**{**vars(float8), "emulate": True})
    plain_adapt = setup.adapt
    try:  # conversion before model.to(device) and torch.compile, where build() puts LoRA's adapters
        setup.adapt = lambda model, c: (
            convert_to_float8_training(
                model.transformer.h, config=float8, module_filter_fn=lambda module, name: only in name
            ),
            plain_adapt(model, c),
        )[1]
        converted = setup.build(cfg, SINGLE, device)
    finally:
        setup.adapt = plain_adapt
    return baseline, converted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt2-124m")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--recipe", default="tensorwise", help="torchao's recipe: tensorwise, rowwise, rowwise_with_gw_hp")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", default="", help="convert only the linear layers whose names hold this (e.g. mlp.)")
    p.add_argument("--emulate", action="store_true", help="float8 emulated in higher precision (CPUs)")
    p.add_argument("--json")
    a = p.parse_args()
    cfg = load_config(a.config, a.overrides)
    device = resolve_device(cfg.train.device)
    pair = build_pair(cfg, device, a.recipe, a.emulate, a.only)
    B, T, V = cfg.train.micro_batch, cfg.model.block_size, cfg.model.vocab_size
    accum = pair[0].grad_accum
    batches = [
        (torch.randint(0, V, (B, T), device=device), torch.randint(0, V, (B, T), device=device)) for _ in range(accum)
    ]
    steps = {
        name: _step(s.train_model, s.model, s.optimizer, s.scaler, batches, s.dtype, cfg.optim.grad_clip)
        for name, s in zip(("bf16", "float8"), pair, strict=True)
    }
    losses: dict[str, list[float]] = {name: [] for name in steps}
    for name, step in steps.items():  # warm-up (and compile) one at a time, the losses kept
        losses[name] += [step().item() for _ in range(a.warmup)]
        _sync(device)
    times = _time_interleaved(steps, device, a.steps)
    tokens = accum * B * T
    result = {
        "config": a.config,
        "recipe": a.recipe,
        "converted": a.only or "every linear layer of the blocks",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "batch_tokens": tokens,
        "tokens_per_s": {name: tokens / sorted(t)[len(t) // 2] for name, t in times.items()},
        "step_ms": {name: [round(1000 * x, 1) for x in t] for name, t in times.items()},
        "warmup_losses": losses,
    }
    result["speedup"] = result["tokens_per_s"]["float8"] / result["tokens_per_s"]["bf16"]
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
