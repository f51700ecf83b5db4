"""`gptforge bench`: time our training step against a reference run in the same process.

The reference is Hugging Face `transformers`' GPT2LMHeadModel of the same shape, batch and optimizer, in fp32
eager mode: what a user would get without gptforge. Warm-up (and compilation) steps are excluded; figures are
medians over the timed steps. Also: sampling tokens/s with and without the KV cache, and tokenization MB/s.
"""

from __future__ import annotations

import gc
import itertools
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gptforge.config import Config
from gptforge.data.sources import stdlib_documents
from gptforge.model.generate import generate
from gptforge.model.gpt import GPT
from gptforge.runtime import dtype_name
from gptforge.runtime.device import autocast, resolve_device
from gptforge.runtime.distributed import SINGLE
from gptforge.runtime.flops import Utilisation, format_flops, format_mfu
from gptforge.tokens.tokenizer import load_tokenizer
from gptforge.train.setup import build
from gptforge.train.step import train_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(step: Callable[[], torch.Tensor], device: torch.device, warmup: int) -> None:
    for _ in range(warmup):
        step()
    _sync(device)


def _time_interleaved(
    candidates: dict[str, Callable[[], torch.Tensor]], device: torch.device, steps: int
) -> dict[str, list[float]]:
    """Step times of each candidate, taking turns step by step so a shared machine's slow spells hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(steps):
        for name, step in candidates.items():
            t = time.perf_counter()
            step().item()  # the loss, read back as the trainer does every step
            _sync(device)
            times[name].append(time.perf_counter() - t)
    return times


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (KiB on Linux)


def _step(train_model, model, optimizer, scaler, batches, dtype, clip) -> Callable[[], torch.Tensor]:
    """The trainer's optimizer step over all `batches` (one per micro-step); returns the loss."""
    next_batch = itertools.cycle(batches).__next__
    return lambda: train_step(train_model, model, optimizer, scaler, next_batch, len(batches), clip, dtype)[0]


def run_bench(cfg: Config, steps: int = 10, warmup: int = 3, reference: bool = True) -> dict[str, Any]:
    """Our training step (built as the trainer builds it) against the reference, sampling and tokenization."""
    device = resolve_device(cfg.train.device)
    s = build(cfg, SINGLE, device)
    B, T, V = cfg.train.micro_batch, cfg.model.block_size, cfg.model.vocab_size
    batch_tokens, dtype, peak = s.grad_accum * B * T, s.dtype, s.peak_flops
    batches = [
        (torch.randint(0, V, (B, T), device=device), torch.randint(0, V, (B, T), device=device))
        for _ in range(s.grad_accum)
    ]
    flops = s.model.flops_per_token(T) * batch_tokens
    candidates = {"ours": _step(s.train_model, s.model, s.optimizer, s.scaler, batches, dtype, cfg.optim.grad_clip)}
    _warm_up(candidates["ours"], device, warmup)
    peak_memory = _peak_memory_mb(device)  # before the reference exists: ours alone
    if reference:
        candidates["reference"], what, ref_batch = _fitting_reference(cfg, batches, device, warmup)
    times = _time_interleaved(candidates, device, steps)
    utilisation = Utilisation(peak, device, dtype)
    ours = _figures(times["ours"], batch_tokens, flops, utilisation)  # may re-probe a peak measured too low
    result: dict[str, Any] = {
        "settings": {
            "device": str(device),
            "dtype": dtype_name(dtype),
            "compile": cfg.train.compile,
            "fused_loss": cfg.model.fused_loss,
            "micro_batch": B,
            "seq_len": T,
            "accumulation": s.grad_accum,
            "vocab_size": V,
            "params": s.model.num_params(),
            "peak_tflops": utilisation.peak / 1e12,
            "peak_source": s.peak_source,
        },
        "ours": ours,
        "ours_peak_memory_mb": peak_memory,
    }
    if reference:
        result["reference"] = {
            **_figures(times["reference"], batch_tokens, flops, utilisation),
            "what": what,
            "micro_batch": ref_batch,
        }
        result["speedup"] = result["reference"]["ms"] / result["ours"]["ms"]
    result["sampling"] = _sampling(s.model, device, dtype)
    result["tokenization_mb_s"] = _tokenization()
    return result


def _figures(times: list[float], batch_tokens: int, flops: float, utilisation: Utilisation) -> dict[str, Any]:
    median = statistics.median(times)
    return {"ms": median * 1000, "tokens_per_s": batch_tokens / median, "mfu": utilisation(flops / median)}


def _reference(cfg: Config, batches: list) -> tuple[Callable[[], torch.Tensor], str]:
    """The optimizer step of transformers' GPT2LMHeadModel of the same shape, in fp32 eager mode, and its name."""
    import transformers

    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.model.vocab_size,
        n_positions=cfg.model.block_size,
        n_embd=cfg.model.n_embd,
        n_layer=cfg.model.n_layer,
        n_head=cfg.model.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # GPT2Config defaults to 50256, outside smaller vocabularies
        eos_token_id=None,
    )
    model = transformers.GPT2LMHeadModel(hf_cfg).to(batches[0][0].device).train()
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
    )
    no_scaling = torch.amp.GradScaler("cuda", enabled=False)
    forward = lambda x, y: (None, model(x, labels=y).loss)  # noqa: E731
    step = _step(forward, model, optimizer, no_scaling, batches, torch.float32, o.grad_clip)
    return step, f"transformers {transformers.__version__} GPT2LMHeadModel, fp32 eager, torch AdamW"


def _fitting_reference(cfg: Config, batches: list, device: torch.device, warmup: int):
    """The reference step, warmed up, and its micro-batch size: halved (same tokens per step, twice the micro-steps)
    until it fits in memory, since the fp32 reference needs far more than our step (GPT-2 124M at 64 x 1024)."""
    while True:
        try:
            step, what = _reference(cfg, batches)
            _warm_up(step, device, warmup)
            return step, what, batches[0][0].size(0)
        except torch.cuda.OutOfMemoryError:
            if batches[0][0].size(0) == 1:
                raise
        # Out of the except block, so the failed attempt's model and activations are no longer referenced.
        step = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        batches = [(xs, ys) for x, y in batches for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True)]


def _sampling(model: GPT, device: torch.device, dtype: torch.dtype, new_tokens: int = 64) -> dict[str, float]:
    model.eval()
    prompt = list(range(16))
    rates = {}
    for name, cache in (("with_cache", True), ("without_cache", False)):
        with autocast(device, dtype):
            generate(model, prompt, 4, temperature=0, use_cache=cache)  # warm-up
            t = time.perf_counter()
            out = generate(model, prompt, new_tokens, temperature=0, use_cache=cache)
            _sync(device)
        rates[name] = len(out[0]) / (time.perf_counter() - t)
    model.train()
    return {**rates, "new_tokens": new_tokens}


def _tokenization(mb: float = 4.0) -> float:
    """GPT-2 BPE MB/s on one core, over the first `mb` MB of this interpreter's stdlib."""
    texts, size = [], 0
    for _, text in stdlib_documents():
        texts.append(text)
        size += len(text.encode())
        if size >= mb * 1e6:
            break
    tok = load_tokenizer("gpt2")
    t = time.perf_counter()
    for text in texts:
        tok.encode(text)
    return size / 1e6 / (time.perf_counter() - t)


def format_bench(r: dict[str, Any], preset: str) -> str:
    """The console report of `gptforge bench` (without --json)."""
    s, o = r["settings"], r["ours"]
    lines = [
        f"{preset}: {s['params']:,} params, {s['micro_batch']} x {s['seq_len']} x {s['accumulation']} "
        f"accumulation, vocab {s['vocab_size']} | {s['device']} {s['dtype']}{' compiled' if s['compile'] else ''}"
        f"{' fused-loss' if s['fused_loss'] else ''} | "
        f"MFU against {format_flops(s['peak_tflops'] * 1e12)} ({s['peak_source']})",
        f"gptforge : {o['tokens_per_s']:10,.0f} tokens/s  {o['ms']:8.1f} ms/step  MFU {format_mfu(o['mfu']):>6}  "
        f"peak memory {r['ours_peak_memory_mb']:,.0f} MB",
    ]
    if "reference" in r:
        ref = r["reference"]
        lines.append(
            f"reference: {ref['tokens_per_s']:10,.0f} tokens/s  {ref['ms']:8.1f} ms/step  "
            f"MFU {format_mfu(ref['mfu']):>6}  ({ref['what']})"
        )
        if ref["micro_batch"] != s["micro_batch"]:
            lines.append(
                f"           (micro-batches of {ref['micro_batch']} to fit in memory; the same tokens per step)"
            )
        lines.append(f"speed-up : {r['speedup']:.2f}x")
    sm = r["sampling"]
    lines.append(
        f"sampling : {sm['with_cache']:,.1f} tokens/s with the KV cache, {sm['without_cache']:,.1f} without "
        f"({sm['new_tokens']} new tokens, batch 1)"
    )
    lines.append(f"tokenize : {r['tokenization_mb_s']:.1f} MB/s GPT-2 BPE, one core")
    return "\n".join(lines)
