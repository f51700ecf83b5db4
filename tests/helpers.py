"""Helpers shared by test modules: reading a run's losses and weights, running the CLI in a subprocess, a lock
held by another process, a randomized tiny model."""

import contextlib
import json
import subprocess
import sys

import torch

from gptforge.checkpoint import load_checkpoint


def losses(run_dir, kind="train"):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == kind}


def cli(*args):
    return [sys.executable, "-m", "gptforge", *map(str, args)]


def randomize(model, matrix_std=None):
    """Random norm gains and biases (so a swapped one shows in logits) and, with `matrix_std`, random matrices of
    that spread; returns the model in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif p.dim() == 1:
                p.normal_(1, 0.1)
            elif matrix_std is not None:
                p.normal_(0, matrix_std)
    return model.eval()


def weights(ckpt):
    return load_checkpoint(ckpt)[0].state_dict()


@contextlib.contextmanager
def lock_held_elsewhere(folder, what="train"):
    """Another process holding `locked(folder)` for the block; yields its pid and SIGKILLs it at the end."""
    program = (
        f"from gptforge.files import locked\nwith locked({str(folder)!r}, {what!r}):\n"
        "    print('held', flush=True)\n    input()"
    )
    holder = subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait(timeout=30)
