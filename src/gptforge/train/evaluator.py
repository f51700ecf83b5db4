"""Evaluation during training: validation loss, HellaSwag and a text sample, logged and printed."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from gptforge.config import Config
from gptforge.data.loader import TokenLoader
from gptforge.data.tokenizer import Tokenizer
from gptforge.eval.hellaswag import evaluate_hellaswag, format_hellaswag, read_examples
from gptforge.eval.loss import evaluate_loss, format_loss
from gptforge.files import append_jsonl
from gptforge.model.generate import generate
from gptforge.rundir import SAMPLES
from gptforge.runtime.device import autocast
from gptforge.runtime.distributed import DistEnv, print0
from gptforge.train.metrics import MetricsLog, NullLog
from gptforge.train.setup import TrainSetup


class Evaluator:
    """Runs at step 0, every `eval.every` steps and at the end, when the data has a validation split."""

    def __init__(
        self,
        cfg: Config,
        setup: TrainSetup,
        tokenizer: Tokenizer,
        has_val: bool,
        metrics: MetricsLog | NullLog,
        run_dir: Path,
        env: DistEnv,
    ) -> None:
        self.cfg, self.setup, self.tokenizer, self.env = cfg, setup, tokenizer, env
        self.metrics, self.run_dir = metrics, run_dir
        B, T = cfg.train.micro_batch, cfg.model.block_size
        self.val_loader = TokenLoader(cfg.data.path, "val", B, T, shuffle=False) if has_val else None  # built once
        self.hellaswag = read_examples(cfg.eval.hellaswag, cfg.eval.hellaswag_limit) if cfg.eval.hellaswag else []
        self.seconds = 0.0
        """How long the last evaluation took (the time budget plans with the first one's)."""

    def due(self, step: int) -> bool:
        return self.val_loader is not None and bool(self.cfg.eval.every) and step % self.cfg.eval.every == 0

    def __call__(self, step: int) -> dict[str, float] | None:
        """The validation result at `step` (None without a validation split); HellaSwag and the sample with it."""
        if self.val_loader is None:
            return None
        t = time.perf_counter()
        s, cfg, env = self.setup, self.cfg, self.env
        B, T = cfg.train.micro_batch, cfg.model.block_size
        val = evaluate_loss(
            s.model, cfg.data.path, B, T, cfg.eval.tokens, s.device, s.dtype, env=env, loader=self.val_loader
        )
        self.metrics.write("val", step, **val)
        if self.hellaswag:
            hs = evaluate_hellaswag(s.model, self.tokenizer, self.hellaswag, s.device, s.dtype, env)
            self.metrics.write("hellaswag", step, **hs)
            print0(self.env, f"step {step:>6} | hellaswag {format_hellaswag(hs)}")
        if cfg.eval.sample_tokens > 0 and env.is_main and math.isfinite(val["loss"]):  # nothing to read otherwise
            print0(self.env, f"step {step:>6} | sample: {self.sample(step)!r}")
        self.seconds = time.perf_counter() - t
        print0(self.env, f"step {step:>6} | val {format_loss(val)} | {self.seconds:.1f}s")
        return val

    def sample(self, step: int) -> str:
        """A continuation of `eval.prompt`, appended to samples.jsonl. Eval mode and a generator seeded per step
        leave the training RNG untouched (dropout would otherwise draw from it), so resumes stay exact."""
        s, prompt = self.setup, self.cfg.eval.prompt
        g = torch.Generator(device=s.device).manual_seed(self.cfg.train.seed + step)
        was_training = s.model.training
        s.model.eval()
        with autocast(s.device, s.dtype):
            new = generate(
                s.model,
                self.tokenizer.encode(prompt),
                self.cfg.eval.sample_tokens,
                top_k=50,
                eot=self.tokenizer.eot,
                generator=g,
            )
        s.model.train(was_training)
        text = prompt + self.tokenizer.decode(new[0])
        append_jsonl(self.run_dir / SAMPLES, {"step": step, "prompt": prompt, "text": text})
        return text
