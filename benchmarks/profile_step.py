"""Where a training step's time goes: the trainer's own step (train/step.py, built as `gptforge bench` builds it, on
random tokens) under the PyTorch profiler, split into its labelled parts (forward with the loss, backward, clipping,
the non-finite check's wait, the optimizer; what is left is data and Python), the ops that take the most time, the
host syncs, and a Chrome trace (open it in https://ui.perfetto.dev). On a GPU a part's device time is measured by
CUDA events recorded on the stream at its start and end (the profiler charges backward's kernels to the forward ops
they differentiate), the top list holds kernels only, each once, and the step is split by kind of kernel: matmul,
attention, loss, normalisation/elementwise, optimizer, other, and idle (the step's wall time no kernel covers).

    python benchmarks/profile_step.py --config gpt2-124m [--set KEY=VALUE ...] [--steps 3] [--warmup 3]
                                      [--trace OUT.json.gz] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import gptforge.train.step as step_module
from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.runtime.device import resolve_device
from gptforge.runtime.distributed import SINGLE
from gptforge.train.setup import build
from gptforge.train.step import PHASES, train_step

# The host's waits for the GPU (a CPU tensor's .item(), e.g. AdamW's step count, waits for nothing).
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# Kinds of kernel by name, first match wins (cuBLAS's Hopper kernels are "nvjet_*"; the fused loss's Triton kernels
# carry its online softmax in their names; Inductor's fused pointwise and reduction kernels are "triton_*").
KINDS = (
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|splitk"),
    ("attention", r"flash|fmha|sdpa|attention"),
    ("loss", r"softmax_online|cross_entropy|nll_loss|log_softmax"),
    ("optimizer", r"multi_tensor|adam|foreach|newton|muon"),
    ("normalisation/elementwise", r"norm|triton_|elementwise|vectorized|reduce|gelu|copy|fill|cat|index"),
)
# Kineto's marker for a launch queue that was full: the host waiting, not a kernel running.
NOT_KERNELS = {"Command Buffer Full"}


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.I)), "other")


class PhaseClock:
    """CUDA events around each labelled part of the step, on the stream its kernels run on: a part's device time is
    what the GPU spent from the end of the work before it to the end of its own."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with record_function(name):
            yield
        end.record()
        self.marks.append((name, start, end))

    def device_ms(self, name: str) -> float:
        return sum(start.elapsed_time(end) for part, start, end in self.marks if part == name)


def _self_us(row, cuda: bool) -> float:
    return getattr(row, "self_device_time_total", 0.0) if cuda else row.self_cpu_time_total


def profile_step(cfg, steps: int, warmup: int, trace: Path | None) -> dict:
    """Profile `steps` optimizer steps after `warmup` (and compilation); times are per step, in ms."""
    device = resolve_device(cfg.train.device)
    cuda = device.type == "cuda"
    s = build(cfg, SINGLE, device)
    B, T, V = cfg.train.micro_batch, cfg.model.block_size, cfg.model.vocab_size
    batches = [(torch.randint(0, V, (B, T), device=device), torch.randint(0, V, (B, T), device=device))] * s.grad_accum
    next_batch = itertools.cycle(batches).__next__

    def step() -> None:
        train_step(
            s.train_model, s.model, s.optimizer, s.scaler, next_batch, s.grad_accum, cfg.optim.grad_clip, s.dtype
        )

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls, clock = [], PhaseClock()
    with profile(activities=activities) as prof, _timed_parts(clock if cuda else None):
        for _ in range(steps):
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            walls.append(time.perf_counter() - start)
    events = prof.events()
    phases = {}
    for name in PHASES:
        mine = [e for e in events if e.name == name]
        phases[name] = {
            "cpu_ms": sum(e.cpu_time_total for e in mine) / steps / 1e3,
            "device_ms": clock.device_ms(name) / steps if cuda else 0.0,
        }
    rows = [r for r in prof.key_averages() if r.key not in PHASES and r.key not in NOT_KERNELS]
    if cuda:  # kernels alone: an op's row would repeat the time of the kernels under it
        rows = [r for r in rows if r.device_type == DeviceType.CUDA]
    rows.sort(key=lambda r: _self_us(r, cuda), reverse=True)
    top = [{"op": r.key, "ms": _self_us(r, cuda) / steps / 1e3, "calls": r.count // steps} for r in rows]
    step_ms = 1e3 * sum(walls) / steps
    kinds = _kinds(top, step_ms) if cuda else None
    if trace:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as f, gzip.open(trace, "wb") as out:
                shutil.copyfileobj(f, out)
    tokens = s.grad_accum * B * T
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "config": {"micro_batch": B, "block_size": T, "accumulation": s.grad_accum, "dtype": str(s.dtype)},
        "step_ms": step_ms,
        "tokens_per_s": tokens / (step_ms / 1e3),
        "phases": phases,
        "outside_phases_cpu_ms": step_ms - sum(p["cpu_ms"] for p in phases.values()),
        "host_syncs_per_step": sum(r.count for r in prof.key_averages() if r.key in SYNCS) / steps if cuda else None,
        "top_ops": top[:20],
        "top_ops_by": "device time, kernels only" if cuda else "self CPU time",
        "kinds_ms": kinds,
    }


@contextlib.contextmanager
def _timed_parts(clock: PhaseClock | None) -> Iterator[None]:
    """The step's labels timed by `clock` while profiling (no clock: the labels as they are)."""
    if clock is None:
        yield
        return
    step_module.record_function = clock
    try:
        yield
    finally:
        step_module.record_function = record_function


def _kinds(kernels: list[dict], step_ms: float) -> dict[str, float]:
    """ms a step by kind of kernel, and idle: the step's wall time that no kernel covers (one stream)."""
    kinds = {kind: 0.0 for kind, _ in KINDS} | {"other": 0.0}
    for k in kernels:
        kinds[kernel_kind(k["op"])] += k["ms"]
    return kinds | {"idle": max(0.0, step_ms - sum(kinds.values()))}


def format_profile(r: dict) -> str:
    lines = [
        f"{r['device']}, torch {r['torch']}, {r['config']}: {r['step_ms']:.1f} ms a step, {r['tokens_per_s']:,.0f} "
        f"tokens/s, {r['host_syncs_per_step']} host syncs a step (the GPU's; none on a CPU)",
        f"{'part':20}{'CPU ms':>10}{'device ms':>11}",
    ]
    lines += [f"{name:20}{p['cpu_ms']:10.2f}{p['device_ms']:11.2f}" for name, p in r["phases"].items()]
    lines += [f"{'outside the parts':20}{r['outside_phases_cpu_ms']:10.2f}", f"top ops by {r['top_ops_by']}:"]
    lines += [f"  {op['ms']:9.2f} ms {op['calls']:5d}x  {op['op'][:90]}" for op in r["top_ops"]]
    if r["kinds_ms"]:
        lines.append("the step by kind of kernel:")
        lines += [f"  {kind:26}{ms:9.2f} ms {ms / r['step_ms']:6.1%}" for kind, ms in r["kinds_ms"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="demo-cpu")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--trace", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        r = profile_step(load_config(args.config, args.set), args.steps, args.warmup, args.trace)
    except GptforgeError as e:
        raise SystemExit(f"profile_step.py: error: {e}") from None
    print(format_profile(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
