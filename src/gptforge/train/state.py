"""The counters of a run that a checkpoint saves and a resume restores."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptforge.errors import GptforgeError
from gptforge.train.optim import Decay


@dataclass
class TrainState:
    max_steps: int
    """Steps the schedule spans (a time budget plans it from the pace, and again as the pace drifts)."""
    step: int = 0
    """Optimizer steps taken (skipped ones included)."""
    tokens: int = 0
    """Training tokens consumed."""
    skipped: int = 0
    """Steps skipped for a non-finite loss or gradient, in all."""
    skipped_in_row: int = 0
    """Of those, the ones since the last applied step."""
    seconds: float = 0.0
    """Wall-clock seconds the run's commands spent so far (a time budget counts them all)."""
    decay: Decay = field(default_factory=Decay)
    """Where the learning rate's decay stands under the plans made so far."""

    def advance(self, applied: bool, tokens: int) -> None:
        self.step += 1
        self.tokens += tokens
        self.skipped_in_row = 0 if applied else self.skipped_in_row + 1
        self.skipped += not applied

    def check_skips(self, max_skips: int, last_good: Path | None) -> None:
        """Stop the run once `max_skips` steps in a row were skipped: the model has diverged or the data is bad."""
        if self.skipped_in_row >= max_skips:
            raise GptforgeError(
                f"{self.skipped_in_row} steps in a row with a non-finite loss or gradient, the last at step "
                f"{self.step}; last good checkpoint: {last_good or 'none yet'} (lower optim.lr or check the data)"
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "max_steps": self.max_steps,
            "skipped_steps": self.skipped,
            "skipped_in_row": self.skipped_in_row,
            "seconds": self.seconds,
            "decay": self.decay.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens, self.max_steps = state["step"], state["tokens"], state["max_steps"]
        self.skipped = state.get("skipped_steps", 0)
        self.skipped_in_row = state.get("skipped_in_row", 0)
        self.seconds = state.get("seconds", 0.0)
        if "decay" in state:  # a checkpoint from before re-plans bent the decay: one plan, lr_at's own
            self.decay.load_state_dict(state["decay"])


def ramp_accumulation(tokens: int, grad_accum: int, ramp_tokens: int) -> int:
    """Micro-steps of the next step. GPT-3's batch ramp grows them linearly with the tokens seen, from 1 to
    grad_accum over `ramp_tokens` (0: the full batch from the start)."""
    if not ramp_tokens:
        return grad_accum
    return max(1, min(grad_accum, math.ceil(grad_accum * (tokens + 1) / ramp_tokens)))
