"""What `gptforge serve PATH` shows: the runs under PATH (or PATH itself, a run or a checkpoint), found again
on every call so runs and checkpoints that training adds appear. Requests name runs, never paths."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gptforge.checkpoint import META, latest_checkpoint
from gptforge.errors import GptforgeError
from gptforge.rundir import CONFIG, METRICS


@dataclass(frozen=True)
class Source:
    """One servable thing: a run folder (curves, samples, its newest checkpoint) or a lone checkpoint."""

    name: str
    folder: Path
    is_checkpoint: bool = False

    def newest_checkpoint(self) -> Path | None:
        return self.folder if self.is_checkpoint else latest_checkpoint(self.folder)


def check_root(path: str | Path) -> Path:
    """PATH as the server will read it: an existing folder (a run, a checkpoint or a folder of runs)."""
    root = Path(path)
    if not root.is_dir():
        raise GptforgeError(f"{path}: not a folder (expected a run folder, a checkpoint or a folder of runs)")
    return root.resolve()


def is_run(folder: Path) -> bool:
    return any((folder / name).exists() for name in (METRICS, CONFIG, "checkpoints"))


def find_sources(root: Path) -> dict[str, Source]:
    """The runs (or the checkpoint) at `root`, by name: root itself, else its sub-folders that are runs, sorted.
    A sub-folder that is a link leading outside root is left out: nothing beyond PATH is read."""
    if (root / META).is_file():
        return {root.name: Source(root.name, root, is_checkpoint=True)}
    if is_run(root):
        return {root.name: Source(root.name, root)}
    found = {}
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        if child.resolve().is_relative_to(root) and is_run(child):
            found[child.name] = Source(child.name, child.resolve())
    return found
