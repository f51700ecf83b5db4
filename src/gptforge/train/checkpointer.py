"""When and how a run saves: checkpoint folders with everything a resume needs, pruning, pushing, resuming."""

from __future__ import annotations

from pathlib import Path

from gptforge.checkpoint import prune_checkpoints, resolve_checkpoint, restore_training_state, save_checkpoint
from gptforge.config import Config
from gptforge.data.prefetch import Prefetcher
from gptforge.data.tokenizer import Tokenizer
from gptforge.hub.publish import export_and_push
from gptforge.runtime.distributed import DistEnv, print0
from gptforge.train.setup import TrainSetup, check_resume_tokenizer
from gptforge.train.state import TrainState


class Checkpointer:
    def __init__(self, run_dir: Path, cfg: Config, tokenizer: Tokenizer, setup: TrainSetup, env: DistEnv) -> None:
        self.run_dir, self.cfg, self.tokenizer, self.setup, self.env = run_dir, cfg, tokenizer, setup, env
        self.last_good: Path | None = None
        """The newest checkpoint this run saved or resumed from."""

    def due(self, step: int) -> bool:
        return bool(self.cfg.checkpoint.every) and step % self.cfg.checkpoint.every == 0

    def save(self, state: TrainState, batches: Prefetcher) -> Path:
        """Weights, optimizer, counters, data position (after the last batch trained on), scaler, RNG; then
        prune old checkpoints and push an export when the config asks."""
        s, ckpt = self.setup, self.cfg.checkpoint
        extra = {**state.state_dict(), "loader": batches.state_dict(), "scaler": s.scaler.state_dict()}
        path = save_checkpoint(
            self.run_dir, state.step, s.model, s.optimizer, self.cfg, self.tokenizer, extra, self.env
        )
        self.last_good = path
        if self.env.is_main and ckpt.keep_last:
            prune_checkpoints(self.run_dir, ckpt.keep_last, ckpt.milestone_every)
        if self.env.is_main and ckpt.push:
            branch = ckpt.push_branch or self.run_dir.resolve().name
            commit = export_and_push(s.model, self.tokenizer, ckpt.push, branch, f"step {state.step}")
            print0(self.env, f"pushed step {state.step} to {ckpt.push} branch {branch} ({commit[:12]})")
        return path

    def restore(self, resume: str, state: TrainState, loader) -> Path:
        """Continue from `resume` ('auto': this run's newest checkpoint, else a path) into the fresh setup."""
        s = self.setup
        ckpt = resolve_checkpoint(self.run_dir if resume == "auto" else resume)
        check_resume_tokenizer(ckpt, self.tokenizer, self.cfg.data.path)
        meta = restore_training_state(ckpt, s.model, s.optimizer, s.device, self.env)
        loader.load_state_dict(meta["loader"])
        state.load_state_dict(meta)
        if meta.get("scaler"):
            s.scaler.load_state_dict(meta["scaler"])
        self.last_good = ckpt
        return ckpt
