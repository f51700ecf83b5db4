"""Evaluation during training: validation loss, HellaSwag, code measures and a text sample, logged and printed."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from gptforge.config import Config
from gptforge.data.loader import TokenLoader
from gptforge.data.mixture import Source
from gptforge.errors import one_line
from gptforge.eval.code import CodeScores, evaluate_code, format_code
from gptforge.eval.hellaswag import evaluate_hellaswag, format_hellaswag, read_examples
from gptforge.eval.loss import bytes_per_token, evaluate_loss, evaluated_tokens, format_loss, mixture_loss
from gptforge.files import append_jsonl
from gptforge.model.generate import generate
from gptforge.model.gpt import GPT
from gptforge.rundir import SAMPLES
from gptforge.runtime.device import autocast
from gptforge.runtime.distributed import DistEnv, broadcast_int, print0
from gptforge.train.metrics import MetricsLog, NullLog
from gptforge.train.setup import Data, TrainSetup

PROBE_WINDOWS = 2  # validation windows timed to size an evaluation under a time budget: a slow host's seconds count
NO_VAL = (
    "no evaluations (validation loss, samples, HellaSwag, code measures); prepare it with --val-fraction above 0 "
    "to have them"
)


def val_loaders(cfg: Config, data: Data) -> dict[Source, TokenLoader]:
    """Each folder's val split, unshuffled; a mix scores each of its folders that has one."""
    B, T = cfg.train.micro_batch, cfg.model.block_size
    return {
        source: TokenLoader(source.path, "val", B, T, shuffle=False)
        for source, manifest in zip(data.sources, data.manifests, strict=True)
        if any(s["split"] == "val" for s in manifest["shards"])
    }


def fit_evaluations(cfg: Config, setup: TrainSetup, data: Data, env: DistEnv, seconds: float) -> tuple[Config, float]:
    """The config with `eval.tokens` cut (said) so that an evaluation's validation loss takes at most about `seconds`,
    timed on PROBE_WINDOWS windows after one for warm-up; and the seconds an evaluation is then expected to take."""
    loaders = val_loaders(cfg, data)
    if not loaders:
        return cfg, 0.0
    (source, loader), T = next(iter(loaders.items())), cfg.model.block_size
    with setup.whole_model() as model:
        for windows in (1, PROBE_WINDOWS):  # the second is timed: the first forward pays for warm-up
            t = time.perf_counter()
            evaluate_loss(
                model, source.path, windows, T, windows * T, setup.device, setup.dtype, env=env, loader=loader
            )
    per_token = max(time.perf_counter() - t, 1e-9) / evaluated_tokens(loader, PROBE_WINDOWS * T)

    def cost(tokens: int) -> float:  # each folder with a val split scores `tokens`
        return per_token * sum(evaluated_tokens(ld, tokens) for ld in loaders.values())

    fitted = int(seconds / per_token / len(loaders)) // T * T
    fitted = broadcast_int(min(cfg.eval.tokens, max(T, fitted)), env, setup.device)  # rank 0's clock decides
    if cost(fitted) < cost(cfg.eval.tokens):
        print0(
            env,
            f"time budget {cfg.train.time_budget:.0f}s: evaluating {evaluated_tokens(loader, fitted):,} validation "
            f"tokens rather than {evaluated_tokens(loader, cfg.eval.tokens):,}, which would take about "
            f"{cost(cfg.eval.tokens):.0f}s, so that evaluations fit it (eval.tokens={fitted})",
        )
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, tokens=fitted)), cost(fitted)


class Evaluator:
    """Runs at step 0, every `eval.every` steps and at the end, when the data has a validation split."""

    def __init__(
        self,
        cfg: Config,
        setup: TrainSetup,
        data: Data,
        metrics: MetricsLog | NullLog,
        run_dir: Path,
        env: DistEnv,
    ) -> None:
        self.cfg, self.setup, self.tokenizer, self.env = cfg, setup, data.tokenizer, env
        self.metrics, self.run_dir, self.mixed = metrics, run_dir, data.mixed
        self.val_loaders = val_loaders(cfg, data)
        if not self.val_loaders:
            print0(env, one_line(f"{', '.join(data.folders)}: no validation split: {NO_VAL}"))
        hellaswag, limit = cfg.eval.hellaswag, cfg.eval.hellaswag_limit
        self.hellaswag = read_examples(hellaswag, limit, flag="eval.hellaswag") if hellaswag else []
        self.seconds = 0.0
        """How long the last evaluation took (the time budget plans with it)."""

    def due(self, step: int) -> bool:
        return bool(self.val_loaders) and bool(self.cfg.eval.every) and step % self.cfg.eval.every == 0

    def __call__(self, step: int) -> dict[str, float] | None:
        """The validation result at `step` (None without a validation split); HellaSwag, the code measures and the
        sample with it."""
        if not self.val_loaders:
            return None
        t = time.perf_counter()
        s, cfg, env = self.setup, self.cfg, self.env
        if not self.seconds:  # the first one also pays for warm-up: say what the wait is
            tokens = sum(evaluated_tokens(loader, cfg.eval.tokens) for loader in self.val_loaders.values())
            extras = f", {len(self.hellaswag):,} HellaSwag examples" if self.hellaswag else ""
            extras += f", code measures (eval.code={cfg.eval.code})" if cfg.eval.code else ""
            if any(loader.manifest.get("chat") for loader in self.val_loaders.values()):
                extras = f" (conversations: the loss scores their replies' tokens alone){extras}"
            print0(env, f"step {step:>6} | evaluating: {tokens:,} validation tokens{extras}...")
        with s.whole_model() as model:
            val = self.validate(model)
            self.metrics.write("val", step, **val)
            if self.hellaswag:
                hs = evaluate_hellaswag(model, self.tokenizer, self.hellaswag, s.device, s.dtype, env)
                self.metrics.write("hellaswag", step, **hs)
                print0(self.env, f"step {step:>6} | hellaswag {format_hellaswag(hs)}")
            if cfg.eval.code and math.isfinite(val["loss"]):  # a diverged model has nothing to write
                scores = self.code(model)
                self.metrics.write("code", step, **dataclasses.asdict(scores))
                print0(self.env, f"step {step:>6} | {format_code(scores)}")
            if cfg.eval.sample_tokens > 0 and env.is_main and math.isfinite(val["loss"]):  # nothing to read else
                print0(self.env, f"step {step:>6} | sample: {self.sample(model, step)!r}")
        self.seconds = time.perf_counter() - t
        print0(self.env, f"step {step:>6} | val {format_loss(val)} | {self.seconds:.1f}s")
        return val

    def validate(self, model: GPT) -> dict[str, float]:
        """Validation loss, perplexity and bits per byte; for a mix, each folder's and their weighted mean."""
        s, B, T = self.setup, self.cfg.train.micro_batch, self.cfg.model.block_size
        scores = {
            source: evaluate_loss(
                model, source.path, B, T, self.cfg.eval.tokens, s.device, s.dtype, env=self.env, loader=loader
            )
            for source, loader in self.val_loaders.items()
        }
        if not self.mixed:
            return next(iter(scores.values()))
        return mixture_loss(
            {source.name: score for source, score in scores.items()},
            shares={source.name: float(source.share) for source in scores},
            bytes_per_token={
                source.name: bytes_per_token(loader.manifest, "val") for source, loader in self.val_loaders.items()
            },
        )

    def code(self, model: GPT) -> CodeScores:
        """The code measures on the first validation folder, the cases shared among the processes: the same cases
        and random streams every time, so the steps compare; the training RNG is untouched."""
        s, source = self.setup, next(iter(self.val_loaders))
        was_training = model.training
        model.eval()
        try:
            return evaluate_code(
                model,
                self.tokenizer,
                source.path,
                self.cfg.eval.code,
                s.device,
                s.dtype,
                seed=self.cfg.train.seed,
                env=self.env,
            )
        finally:
            model.train(was_training)

    def sample(self, model: GPT, step: int) -> str:
        """A continuation of `eval.prompt`, appended to samples.jsonl. Eval mode and a generator seeded per step
        leave the training RNG untouched (dropout would otherwise draw from it), so resumes stay exact."""
        s, prompt = self.setup, self.cfg.eval.prompt
        g = torch.Generator(device=s.device).manual_seed(self.cfg.train.seed + step)
        was_training = model.training
        model.eval()
        with autocast(s.device, s.dtype):
            new = generate(
                model,
                self.tokenizer.encode(prompt) or [self.tokenizer.eot],  # empty: a fresh document, as `sample`
                self.cfg.eval.sample_tokens,
                top_k=50,
                eot=self.tokenizer.eot,
                generator=g,
            )
        model.train(was_training)
        text = prompt + self.tokenizer.decode(new[0])
        append_jsonl(self.run_dir / SAMPLES, {"step": step, "prompt": prompt, "text": text})
        return text
