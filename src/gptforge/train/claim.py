"""Which folder a run may write: never the data, never another run's or the user's files."""

from __future__ import annotations

from pathlib import Path

from gptforge.checkpoint import checkpoints
from gptforge.errors import GptforgeError
from gptforge.files import LOCK, is_empty_dir
from gptforge.outputs import check_output_dir
from gptforge.rundir import CONFIG, METRICS, SAMPLES
from gptforge.train.metrics import WANDB_ID

# What a run folder holds before its first checkpoint: a folder of only these is an attempt that never saved.
RUN_FILES = {CONFIG, METRICS, SAMPLES, "checkpoints", "tensorboard", "wandb", WANDB_ID, LOCK}


def claim_run_dir(run_dir: Path, resume_from: Path | None, data_paths: list[str]) -> None:
    """Refuse to start in a folder that holds other files: continuing a run needs --resume, a checkpoint of
    another run resumes only into an empty folder (two runs' files never mix), and never into the data."""
    check_output_dir(run_dir, force=True, reads=data_paths, is_run=True)
    if is_empty_dir(run_dir):
        return
    if resume_from is not None and run_dir.resolve() in resume_from.resolve().parents:
        return
    if resume_from is None and not checkpoints(run_dir) and {p.name for p in run_dir.iterdir()} <= RUN_FILES:
        return  # an earlier attempt stopped before its first checkpoint: start over, its log lines are superseded
    if resume_from is not None:
        raise GptforgeError(f"--out {run_dir}: already holds a run; resume {resume_from} into an empty or new folder")
    if checkpoints(run_dir):
        raise GptforgeError(
            f"--out {run_dir}: already holds a run; continue it with --resume auto, or pick another --out"
        )
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_FILES)
    raise GptforgeError(
        f"--out {run_dir}: holds files that are not a run's ({', '.join(others[:3])}...); pick a new folder"
    )
