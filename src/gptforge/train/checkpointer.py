"""When and how a run saves: checkpoint folders with everything a resume needs, pruning, pushing, resuming."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from gptforge.checkpoint import (
    Saving,
    begin_checkpoint,
    checkpoint_problem,
    checkpoints,
    end_checkpoint,
    prune_checkpoints,
    read_meta,
    resolve_checkpoint,
    restore_training_state,
    step_of,
    weights_finite,
    weights_misfit,
)
from gptforge.config import Config, config_from_dict, load_config, to_dict
from gptforge.data.prefetch import Prefetcher
from gptforge.errors import GptforgeError
from gptforge.hub.publish import export_and_push
from gptforge.runtime.distributed import DistEnv, print0
from gptforge.runtime.fsdp import is_sharded
from gptforge.train.setup import Data, TrainSetup, check_resume_tokenizer
from gptforge.train.state import TrainState


class Checkpointer:
    def __init__(self, run_dir: Path, cfg: Config, data: Data, setup: TrainSetup, env: DistEnv) -> None:
        self.run_dir, self.cfg, self.tokenizer, self.setup, self.env = run_dir, cfg, data.tokenizer, setup, env
        self.folders = data.folders
        self.data = data
        """What a resume compares against (the data may change under a run)."""
        self.last_good: Path | None = None
        """The newest checkpoint this run saved or resumed from."""
        self.seconds = 0.0
        """What the last save took (of the training's time: a background write's own time is not counted)."""
        self.pending: tuple[Saving, bool] | None = None
        """A checkpoint being written in the background, and whether it may become `last_good`."""
        self.background = None
        if cfg.checkpoint.async_save and is_sharded(setup.model):  # every rank builds this at once
            self.background = torch.distributed.new_group(backend="gloo")  # the writes' own collectives

    def due(self, step: int) -> bool:
        return bool(self.cfg.checkpoint.every) and step % self.cfg.checkpoint.every == 0

    def save(self, state: TrainState, batches: Prefetcher, background: bool = False) -> Path:
        """Weights, optimizer, counters, data position (after the last batch trained on), scaler, RNG; then
        prune old checkpoints and push an export when the config asks. With `background` (and async_save under
        fsdp) the shards are written on a thread and all that follows waits for `settle`."""
        s, t0 = self.setup, time.perf_counter()
        self.settle()
        if not weights_finite(s.model, self.env):  # stop here: every later step would be skipped as well
            raise GptforgeError(
                f"step {state.step}: the model's weights are not finite (NaN or inf): not saved, nothing pruned; "
                f"last good checkpoint: {self.last_good or 'none yet'} (lower optim.lr or check the data)"
            )
        extra = {**state.state_dict(), "loader": batches.state_dict(), "scaler": s.scaler.state_dict()}
        extra["data"] = self.data.fingerprint
        saving = begin_checkpoint(
            self.run_dir, state.step, s.model, s.optimizer, self.cfg, self.tokenizer,
            extra=extra, env=self.env, background=self.background if background else None,
        )  # fmt: skip
        self.pending = (saving, not state.skipped_in_row)  # weights saved amid skipped steps are suspect
        if saving.writes is None:
            self.settle()
        self.seconds = time.perf_counter() - t0
        return saving.final

    def settle(self) -> None:
        """Put a checkpoint written in the background in place (waiting for its writes), prune, push."""
        if self.pending is None:
            return
        (saving, good), self.pending, ckpt = self.pending, None, self.cfg.checkpoint
        path = end_checkpoint(saving, self.env)
        self.last_good = path if good else self.last_good
        if self.env.is_main and ckpt.keep_last:
            prune_checkpoints(self.run_dir, ckpt.keep_last, ckpt.milestone_every, spare=self.last_good)
        if ckpt.push:
            self._push(step_of(path))

    def _push(self, step: int) -> None:
        """An export of the weights to checkpoint.push's branch (rank 0; every process gathers them under fsdp)."""
        ckpt = self.cfg.checkpoint
        with self.setup.whole_model() as model:
            if self.env.is_main:
                branch = ckpt.push_branch or self.run_dir.resolve().name
                commit = export_and_push(model, self.tokenizer, ckpt.push, branch, f"step {step}")
                print0(self.env, f"pushed step {step} to {ckpt.push} branch {branch} ({commit[:12]})")

    def restore(self, ckpt: Path, state: TrainState, loader) -> list[str]:
        """Continue from `ckpt` into the fresh setup; returns the settings that changed since it was saved, each
        honoured ('key: old -> new'). A new train.max_steps re-spans the schedule from the step reached."""
        s = self.setup
        check_resume_tokenizer(ckpt, self.tokenizer, self.folders[0])  # before the shapes could mismatch
        before = config_from_dict(read_meta(ckpt)["config"])
        misfit = weights_misfit(s.model, ckpt)
        changes = config_changes(before, self.cfg, misfit)  # refuses a new structure before loading anything
        meta = restore_training_state(ckpt, s.model, s.optimizer, s.device, self.env)
        changed = self.data.changed_since(meta.get("data"))
        if changed:
            warnings.warn(
                f"the data in {', '.join(changed)} is not what {ckpt} trained on (its shards differ): "
                "the saved data position now points into other text",
                stacklevel=2,
            )
        loader.load_state_dict(meta["loader"])
        was = (meta["loader"]["world_size"], meta["loader"]["batch_size"])
        if was != (self.env.world_size, self.cfg.train.micro_batch):
            print0(
                self.env,
                f"the data position carries over from {was[0]} process(es) x {was[1]} sequences to "
                f"{self.env.world_size} x {self.cfg.train.micro_batch}: the same global batches follow",
            )
        state.load_state_dict(meta)
        if meta.get("scaler"):
            s.scaler.load_state_dict(meta["scaler"])
        self.last_good = _last_good(ckpt)
        if self.cfg.train.max_steps != before.train.max_steps:
            if self.cfg.train.max_steps <= state.step:
                raise GptforgeError(
                    f"train.max_steps={self.cfg.train.max_steps}: {ckpt} is already at step {state.step}"
                )
            state.max_steps = self.cfg.train.max_steps
        budget = self.cfg.train.time_budget
        plans = f" (the time budget plans again: {state.seconds:.0f}s of {budget:.0f}s spent)" if budget else ""
        print0(self.env, f"resumed from {ckpt} at step {state.step} of {state.max_steps}{plans}")
        for change in changes:
            print0(self.env, f"  changed since that checkpoint: {change}")
        return changes


def _last_good(ckpt: Path) -> Path | None:
    """`ckpt`, or the newest checkpoint of its run before it, that was not saved in a run of skipped steps."""
    older = [p for p in checkpoints(ckpt.parent.parent) if step_of(p) <= step_of(ckpt)]
    return next((p for p in reversed(older) if _saved_cleanly(p)), None)


def _saved_cleanly(ckpt: Path) -> bool:
    return checkpoint_problem(ckpt) is None and not read_meta(ckpt).get("skipped_in_row", 0)


def find_resume(run_dir: Path, resume: str | None) -> Path | None:
    """The checkpoint to continue from: 'auto' is the run's newest intact one (none yet: start fresh),
    anything else a checkpoint or run folder."""
    if not resume or (resume == "auto" and not checkpoints(run_dir)):
        return None
    return resolve_checkpoint(run_dir if resume == "auto" else resume, for_training=True)


def resume_config(run_dir: Path, resume: str, overrides: list[str]) -> Config:
    """What `train --resume` without --config continues with: the checkpoint's own config plus `overrides`."""
    ckpt = find_resume(run_dir, resume)
    if ckpt is None:
        raise GptforgeError(f"--resume {resume}: {run_dir} has no checkpoint yet; give --config to start the run")
    return load_config(overrides=overrides, base=config_from_dict(read_meta(ckpt)["config"]))


# Model fields that shape the weights: a resume cannot change them.
SHAPE = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "vocab_multiple")
# Model fields that decide which weights there are and what they compute.
STRUCTURE = (*SHAPE, "norm", "position", "qk_norm", "bias", "tie_embeddings", "mlp", "mlp_hidden")


def config_changes(before: Config, now: Config, misfit: str | None = None) -> list[str]:
    """'section.key: old -> new' for each setting that differs. Another optimizer, a change of the model's structure, or
    `misfit` (how the checkpoint's weights differ from the new model's) is an error naming the keys."""
    old, new = to_dict(before), to_dict(now)
    changes = [
        f"{section}.{key}: {old[section].get(key)!r} -> {value!r}"
        for section, values in new.items()
        for key, value in values.items()
        if old[section].get(key) != value
    ]
    if before.optim.optimizer != now.optim.optimizer:
        raise GptforgeError(
            f"optim.optimizer={now.optim.optimizer}: the checkpoint trained with {before.optim.optimizer}, and a "
            f"resume continues its optimizer's state (resume with optim.optimizer={before.optim.optimizer}, or start "
            "a new run from its weights with train.init_from)"
        )
    if before.train.init_from != now.train.init_from:  # the weights come from the checkpoint, whatever it names
        raise GptforgeError(
            f"train.init_from={now.train.init_from!r}: the run started from {before.train.init_from!r}, and a resume "
            "continues from its own checkpoint (resume with the same train.init_from, or with --resume alone)"
        )
    if (before.data.fim_rate > 0) != (now.data.fim_rate > 0):
        raise GptforgeError(
            f"data.fim_rate={now.data.fim_rate}: the checkpoint trained with data.fim_rate={before.data.fim_rate}, "
            "and turning fill-in-the-middle on or off adds or removes its 3 sentinel tokens, a change of the "
            "vocabulary a resume cannot make (change the rate between non-zero values, or train a new run)"
        )
    differ = [k for k in STRUCTURE if getattr(before.model, k) != getattr(now.model, k)]
    if misfit or differ:  # weights of the same shapes (gelu -> relu2, layernorm -> rmsnorm) compute something else
        theirs = ", ".join(f"model.{k}={getattr(before.model, k)!r} (now {getattr(now.model, k)!r})" for k in differ)
        raise GptforgeError(
            f"the checkpoint's model has {theirs or 'other weights'}; a resume cannot change the model's structure"
            f"{f' (its weights against the new model: {misfit})' if misfit else ''}: resume with the run's own "
            "model settings, or train the new model in a new folder"
        )
    return changes
