"""Helpers shared by test modules: reading a run's losses and weights, running the CLI in a subprocess."""

import json
import sys

from gptforge.checkpoint import load_checkpoint


def losses(run_dir, kind="train"):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == kind}


def cli(*args):
    return [sys.executable, "-m", "gptforge", *map(str, args)]


def weights(ckpt):
    return load_checkpoint(ckpt)[0].state_dict()
