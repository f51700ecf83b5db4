"""`gptforge plan`: the memory a training config needs on each GPU under ddp, ddp + zero and fsdp, the largest
micro-batch that fits, and the time and GPU-hours its token budget takes at a stated MFU.

An analytic model: parameters, gradients and optimizer state are counted exactly; activations are what each token
keeps for backward in a compiled bf16 step with flash attention (counted per tensor below), times one factor
measured on an H100 (gpt2-124m at 64 x 1024: 26.7 GiB; benchmarks/RESULTS.md) for what the allocator holds besides.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from gptforge.config import Config
from gptforge.config.rules import validate
from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPTConfig
from gptforge.runtime.flops import GPU_PEAK_TFLOPS

STRATEGIES = ("ddp", "zero", "fsdp")  # train.parallel=ddp, ddp with train.zero=true, train.parallel=fsdp
GIB = 2**30
# What the allocator holds besides the tensors counted (workspaces, fragmentation): gpt2-124m's measured 26.7 GiB.
# Checked on the two other H100 figures: speedrun-124m 29.3 GiB (planned 29.4), model.fused_loss=false 29.6 (33.6).
OVERHEAD = 1.18


@dataclass(frozen=True)
class Hardware:
    gpus: int = 1
    """GPUs per node."""
    nodes: int = 1
    memory_gib: float = 80.0
    """Memory of one GPU."""
    peak_tflops: float = 0.0
    """One GPU's dense peak in the run's precision (0: an H100 SXM's, bf16 or tf32 for a float32 run)."""
    mfu: float = 0.38
    """The share of the peak the step reaches (gptforge measured 38.2% for gpt2-124m on an H100)."""

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


@dataclass(frozen=True)
class Memory:
    """Bytes on one GPU."""

    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class Plan:
    strategy: str
    micro_batch: int
    accumulation: int
    memory: Memory
    """At `micro_batch`, with the config's activation checkpointing."""
    checkpointed: Memory
    """The same with activation checkpointing on."""
    largest_micro_batch: int
    """The largest that fits and divides the step's batch (0: not even one sequence)."""
    fits: bool
    refused: str | None
    """Why `train` would refuse this strategy with the config (e.g. Muon under fsdp), or None."""


def _layer_bytes(m: GPTConfig, e: int) -> float:
    """Bytes one token keeps for backward in one block: each norm's fp32 input (the residual stream) and the
    `e`-byte tensors each op saves (2 in bf16 autocast, 4 in fp32)."""
    h, H = m.n_embd, m.hidden_size
    attention = 4 * h + e * (h + 3 * h + h)  # norm input, its output, q/k/v, attention output
    if m.position == "rotary" or m.qk_norm:
        attention += e * 2 * h  # q and k again, as rotated or normed
    mlp_in = 4 * h + e * h
    inner = e * (3 * H if m.mlp == "swiglu" else 2 * H)  # gate, up and their product; or fc output and activation
    return attention + mlp_in + inner


def _activations(cfg: Config, micro_batch: int, checkpointed: bool) -> float:
    """Activation bytes for one micro-batch, on one GPU."""
    m, tokens = cfg.model, micro_batch * cfg.model.block_size
    e = 4 if cfg.train.dtype == "float32" else 2
    layer = _layer_bytes(m, e)
    layers = m.n_layer * 4 * m.n_embd + layer if checkpointed else m.n_layer * layer  # inputs, one block recomputed
    edges = 4 * m.n_embd + (4 + e) * m.n_embd  # the embedding's output; the final norm's input and output
    # The fused loss keeps the gradient of h (its logits live a chunk at a time, freed before backward's peak);
    # the plain one keeps the logits.
    head = 4 * m.n_embd * tokens if m.fused_loss else e * tokens * m.padded_vocab_size
    return OVERHEAD * ((layers + edges) * tokens + head)


def _matrices(m: GPTConfig) -> int:
    """The blocks' 2-D weights (what Muon takes)."""
    return m.n_layer * (4 * m.n_embd**2 + (3 if m.mlp == "swiglu" else 2) * m.n_embd * m.hidden_size)


def _state(cfg: Config, strategy: str, world: int, accumulation: int) -> tuple[float, float, float]:
    """Bytes of parameters, gradients and optimizer state on one GPU."""
    m, P = cfg.model, cfg.model.num_weights
    optimizer = 8 * P if cfg.optim.optimizer == "adamw" else 4 * _matrices(m) + 8 * (P - _matrices(m))
    if strategy == "fsdp" and world > 1:
        compute = 4 if cfg.train.dtype == "float32" else 2
        block = (P - _root(m)) / m.n_layer
        # The root for the whole step, a block and the next one; without resharding every block stays gathered
        # from its forward to its backward.
        gathered = compute * (_root(m) + 2 * block if cfg.train.reshard_after_forward else P)
        unsynced = 4 * P if accumulation > 1 else 0  # micro-steps accumulate unsharded gradients in fp32 (reduce)
        return 4 * P / world + gathered, 4 * P / world + unsynced, optimizer / world
    buckets = 4 * P if world > 1 else 0  # DDP's gradient buckets beside the gradients
    return 4 * P, 4 * P + buckets, optimizer / world if strategy == "zero" and world > 1 else optimizer


def _root(m: GPTConfig) -> int:
    """Weights outside the blocks: embeddings, positions, head, final norm (FSDP's root unit)."""
    tables = (1 if m.tie_embeddings else 2) * m.padded_vocab_size * m.n_embd
    return tables + (m.block_size * m.n_embd if m.position == "learned" else 0) + 2 * m.n_embd


def memory(cfg: Config, strategy: str, world: int, micro_batch: int, checkpointed: bool) -> Memory:
    """Bytes on one GPU for a step at `micro_batch` sequences per micro-step."""
    accumulation = max(1, cfg.train.batch_tokens // (micro_batch * cfg.model.block_size * world))
    params, grads, optimizer = _state(cfg, strategy, world, accumulation)
    return Memory(params, grads, optimizer, _activations(cfg, micro_batch, checkpointed))


def grad_accumulation(cfg: Config, world: int) -> int:
    """Micro-steps per optimizer step: what the processes' micro-batches leave of the global token batch."""
    B, T = cfg.train.micro_batch, cfg.model.block_size
    if B <= 0 or cfg.train.batch_tokens <= 0 or cfg.train.batch_tokens % (B * T * world):
        raise GptforgeError(
            f"train.batch_tokens={cfg.train.batch_tokens} must be a positive multiple of "
            f"train.micro_batch x model.block_size x processes = {B} x {T} x {world}"
        )
    return cfg.train.batch_tokens // (B * T * world)


def _divisors(n: int) -> list[int]:
    """n's divisors, ascending, in about sqrt(n) steps (a step may hold 2**40 tokens)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _refusal(cfg: Config, strategy: str) -> str | None:
    """Why the config cannot run under `strategy` (the rule `train` would apply), or None."""
    parallel = "fsdp" if strategy == "fsdp" else "ddp"
    train = dataclasses.replace(cfg.train, parallel=parallel, zero=strategy == "zero")
    try:
        validate(dataclasses.replace(cfg, train=train))
    except GptforgeError as e:
        return str(e)
    return None


def plan(cfg: Config, strategy: str, hardware: Hardware) -> Plan:
    """What `strategy` needs on `hardware` for `cfg` (whose micro-batch divides the step: `grad_accumulation`), and
    the largest micro-batch that fits its memory."""
    world, T, budget = hardware.world, cfg.model.block_size, hardware.memory_gib * GIB
    accumulation = grad_accumulation(cfg, world)
    checkpointed = cfg.model.activation_checkpointing
    sizes = _divisors(cfg.train.batch_tokens // (T * world))
    largest = max((b for b in sizes if memory(cfg, strategy, world, b, checkpointed).total <= budget), default=0)
    B = cfg.train.micro_batch
    mem = memory(cfg, strategy, world, B, checkpointed)
    return Plan(
        strategy=strategy,
        micro_batch=B,
        accumulation=accumulation,
        memory=mem,
        checkpointed=memory(cfg, strategy, world, B, True),
        largest_micro_batch=largest,
        fits=mem.total <= budget,
        refused=_refusal(cfg, strategy),
    )


def with_peak(cfg: Config, hardware: Hardware) -> Hardware:
    """`hardware` with its peak stated: an H100 SXM's in the run's precision unless given (float32 matmuls run in
    tf32, at half the bf16 rate)."""
    if hardware.peak_tflops:
        return hardware
    bf16, tf32 = GPU_PEAK_TFLOPS["H100"]
    return dataclasses.replace(hardware, peak_tflops=tf32 if cfg.train.dtype == "float32" else bf16)


def hours(cfg: Config, hardware: Hardware) -> tuple[float, float]:
    """(wall-clock hours, GPU-hours) for the config's token budget at the hardware's MFU, or for train.time_budget
    when that ends the run first (it stops the run within it)."""
    seconds = min(_steps_seconds(cfg, hardware), cfg.train.time_budget or math.inf)
    return seconds / 3600, seconds * hardware.world / 3600


def _steps_seconds(cfg: Config, hardware: Hardware) -> float:
    """Wall-clock seconds of train.max_steps at the hardware's MFU."""
    hardware = with_peak(cfg, hardware)
    tokens = float(cfg.train.max_steps) * cfg.train.batch_tokens
    return cfg.model.flops_per_token() * tokens / (hardware.world * hardware.peak_tflops * 1e12 * hardware.mfu)


def strategy_of(cfg: Config) -> str:
    return "fsdp" if cfg.train.parallel == "fsdp" else "zero" if cfg.train.zero else "ddp"


# The plan's accuracy against measured peaks (within 15%): `train` refuses only what exceeds the memory by more.
TOLERANCE = 1.15


def check_fits(cfg: Config, processes: int, memory_gib: float) -> None:
    """Refuse, in one line, a run whose plan exceeds each GPU's `memory_gib` by more than the plan's tolerance."""
    p = plan(cfg, strategy_of(cfg), Hardware(gpus=processes, memory_gib=memory_gib))
    need = p.memory.total / GIB
    if need <= memory_gib * TOLERANCE:
        return
    hint = f"train.micro_batch={p.largest_micro_batch} fits" if p.largest_micro_batch else "no micro-batch fits"
    if not p.largest_micro_batch and not cfg.model.activation_checkpointing:
        hint += f" (with model.activation_checkpointing=true it needs {p.checkpointed.total / GIB:,.1f} GiB)"
    raise GptforgeError(
        f"train.micro_batch={cfg.train.micro_batch}: the plan needs {need:,.1f} GiB on each GPU, which has "
        f"{memory_gib:,.1f} GiB; {hint} (`gptforge plan` lists the options: ddp, zero, fsdp, more GPUs)"
    )


def report(cfg: Config, name: str, hardware: Hardware) -> dict:
    """What `gptforge plan` prints, as data: the config, the hardware, each strategy's plan and the time."""
    hardware = with_peak(cfg, hardware)
    wall, gpu_hours = hours(cfg, hardware)
    full = _steps_seconds(cfg, hardware)
    return {
        "config": name,
        "parameters": cfg.model.num_weights,
        "vocab_size": cfg.model.vocab_size,
        "block_size": cfg.model.block_size,
        "batch_tokens": cfg.train.batch_tokens,
        "tokens": cfg.train.batch_tokens * min(cfg.train.max_steps, int(cfg.train.max_steps * wall * 3600 / full)),
        "hardware": dataclasses.asdict(hardware),
        "plans": [
            {**dataclasses.asdict(p), "total_gib": p.memory.total / GIB, "checkpointed_gib": p.checkpointed.total / GIB}
            for p in (plan(cfg, s, hardware) for s in STRATEGIES)
        ],
        "hours": wall,
        "gpu_hours": gpu_hours,
        "time_budget_ends_it": wall * 3600 < full,
    }


def format_report(r: dict) -> str:
    """The report as a table, GiB per GPU."""
    hw = r["hardware"]
    lines = [
        f"{r['config']}: {r['parameters']:,} parameters (vocabulary {r['vocab_size']:,}: set model.vocab_size to "
        f"your tokenizer's), context {r['block_size']}, {r['batch_tokens']:,} tokens a step, {r['tokens']:,} tokens",
        f"on {hw['nodes']} node(s) x {hw['gpus']} GPU(s) of {hw['memory_gib']:g} GiB (GiB per GPU below)",
        f"{'':6}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}{'total':>9}{'ckpt':>9}  micro-batch  largest  accum",
    ]
    for p in r["plans"]:
        m = p["memory"]
        cells = "".join(f" {m[k] / GIB:8.2f}" for k in ("params", "grads", "optimizer", "activations"))
        verdict = "" if p["fits"] else "  does not fit"
        if p["refused"]:
            verdict += f"  refused: {p['refused'].split(':')[0]}"
        lines.append(
            f"{p['strategy']:6}{cells} {p['total_gib']:8.2f} {p['checkpointed_gib']:8.2f}  {p['micro_batch']:>11}  "
            f"{p['largest_micro_batch']:>7}  {p['accumulation']:>5}{verdict}"
        )
    lines.append(
        f"time: {_hours(r['hours'])} h ({_hours(r['gpu_hours'])} GPU-hours)"
        f"{', train.time_budget ends it' if r['time_budget_ends_it'] else ''} at {hw['mfu'] * 100:g}% MFU of "
        f"{hw['peak_tflops']:g} TFLOP/s; ckpt = with model.activation_checkpointing=true"
    )
    lines.append("checked: within 15% of the peaks measured on one H100 in bf16; several GPUs not measured yet")
    return "\n".join(lines)


def _hours(h: float) -> str:
    """Hours with thousands separators, or three significant digits under 0.1 (a minute of 512 GPUs is not "0.0") and
    in powers of ten past a million (an absurd budget or MFU prints a short figure, not hundreds of digits)."""
    return f"{h:,.1f}" if 0.1 <= h < 1e6 else f"{h:.3g}"
