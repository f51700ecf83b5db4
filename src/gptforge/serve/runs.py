"""What `gptforge serve PATH` shows: the runs under PATH (or PATH itself, a run or a checkpoint), found again
on every call so runs and checkpoints that training adds appear. Requests name runs, never paths, and nothing
beyond PATH is read: every file and folder is opened only if, its links followed, it stays inside PATH."""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gptforge.checkpoint import META, checkpoint_problem, checkpoints
from gptforge.errors import GptforgeError
from gptforge.inputs import printable
from gptforge.rundir import CONFIG, METRICS

VERDICTS_KEPT = 256  # checkpoints whose verdict is remembered (training adds one per save; pruned ones are dropped)


class FolderGone(GptforgeError):
    """The served folder was deleted or renamed while serving: every route says so until it is back."""


def inside(root: Path, path: Path) -> Path | None:
    """`path` with its links followed, if that stays inside `root`; else None, with a warning in the log
    (once per path): a link leading elsewhere is treated as absent."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError):  # a link loop
        return None
    if real.is_relative_to(root.resolve()):
        return real
    warnings.warn(f"{path} leads outside the served folder (to {real}): not read", stacklevel=2)
    return None


@dataclass(frozen=True)
class Source:
    """One servable thing under `root` (PATH): a run folder (curves, samples, its checkpoints) or a checkpoint."""

    name: str
    folder: Path
    root: Path
    is_checkpoint: bool = False

    def file(self, name: str) -> Path | None:
        """The real path of its file `name`, if it exists inside PATH."""
        path = inside(self.root, self.folder / name)
        return path if path is not None and path.is_file() else None

    def checkpoints(self) -> Iterator[Path]:
        """Its complete checkpoints, newest first, leaving out any with a file or folder that leads outside PATH."""
        if self.is_checkpoint:
            found = [self.folder]
        else:
            found = checkpoints(self.folder) if inside(self.root, self.folder / "checkpoints") else []
        return (ckpt for ckpt in reversed(found) if self._verdict(ckpt).confined)

    def newest_checkpoint(self) -> Path | None:
        """The newest intact one (what the model answers with); with none intact the newest, whose damage a request
        is then told of; None without checkpoints."""
        intact = next((ckpt for ckpt in self.checkpoints() if self._verdict(ckpt).problem is None), None)
        return intact or next(self.checkpoints(), None)

    def intact_checkpoint(self, failed: dict[Path, str] | None = None) -> Path:
        """The newest checkpoint that can be loaded: a damaged newer one (or one in `failed`, whose load found
        damage) is skipped with a warning."""
        problems = []
        for ckpt in self.checkpoints():
            problem = (failed or {}).get(ckpt) or self._verdict(ckpt).problem
            if problem is None:
                return ckpt
            warnings.warn(f"{ckpt}: damaged checkpoint ({problem}); falling back to the previous one", stacklevel=2)
            problems.append(f"{ckpt.name}: {problem}")
        raise GptforgeError(f"the model '{self.name}' has no intact checkpoint ({'; '.join(problems) or 'none'})")

    def damaged(self, ckpt: Path, problem: str) -> None:
        """A load found damage the checks do not look for (a file no longer matching its checksum): the checkpoint
        is skipped like any damaged one, without being read again, until its files change."""
        _VERDICTS[(self.root, ckpt)] = (_signature(ckpt), Verdict(True, problem))

    def _verdict(self, ckpt: Path) -> Verdict:
        """The checks below, made again only when the folder's entries change: every request looks its model up,
        and the checks read and parse files (a millisecond a request, a small model's whole step)."""
        key, now = (self.root, ckpt), _signature(ckpt)
        known = _VERDICTS.get(key)
        if known is None or known[0] != now or now is None:
            confined = self._confined(ckpt)
            known = (now, Verdict(confined, checkpoint_problem(ckpt) if confined else None))
            if len(_VERDICTS) >= VERDICTS_KEPT:
                _VERDICTS.clear()
            _VERDICTS[key] = known
        return known[1]

    def _confined(self, ckpt: Path) -> bool:
        """The checkpoint folder and every file in it stay inside PATH (its tokenizer is one of them, by name)."""
        try:
            return inside(self.root, ckpt) is not None and all(inside(self.root, p) for p in ckpt.iterdir())
        except OSError:  # pruned by training a moment ago
            return False


@dataclass(frozen=True)
class Verdict:
    confined: bool  # the folder and its files stay inside PATH (a checkpoint that does not is not listed)
    problem: str | None  # why it cannot be loaded (checkpoint_problem), for one that is confined


_VERDICTS: dict[tuple[Path, Path], tuple[tuple | None, Verdict]] = {}


def _signature(folder: Path) -> tuple | None:
    """Every entry below `folder` and the folder itself as lstat sees them (kind, size, times, inode): a rewrite,
    a truncation, a link put in a file's place all change it. None (never matched) when it cannot be read, or holds
    a link: where a link leads, outside PATH even, can change with nothing here changing."""
    try:
        entries, folders = [_stat(os.lstat(folder), str(folder))], [str(folder)]
        while folders:
            with os.scandir(folders.pop()) as found:
                for entry in found:
                    entries.append(_stat(entry.stat(follow_symlinks=False), entry.path))
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
    except OSError:
        return None
    return None if any(stat.S_ISLNK(entry[1]) for entry in entries) else tuple(sorted(entries))


def _stat(st: os.stat_result, path: str) -> tuple:
    return path, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def check_root(path: str | Path) -> Path:
    """PATH as the server will read it: an existing folder (a run, a checkpoint or a folder of runs)."""
    root = Path(path)
    if not root.is_dir():
        raise GptforgeError(f"{path}: not a folder (expected a run folder, a checkpoint or a folder of runs)")
    return root.resolve()


def is_run(root: Path, folder: Path) -> bool:
    real = (inside(root, folder / name) for name in (METRICS, CONFIG, "checkpoints"))
    return any(path is not None and path.exists() for path in real)


def find_sources(root: Path) -> dict[str, Source]:
    """The runs (or the checkpoint) at `root`, by printable name: root itself, else its sub-folders that are runs,
    sorted. A sub-folder that is a link leading outside root is left out."""
    gone = f"{root}: the served folder is gone (deleted or renamed while serving); it is served again once it is back"
    if not root.is_dir():
        raise FolderGone(gone)
    meta, name = inside(root, root / META), printable(root.name)
    if meta is not None and meta.is_file():
        return {name: Source(name, root, root, is_checkpoint=True)}
    if is_run(root, root):
        return {name: Source(name, root, root)}
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:  # deleted between the two calls
        raise FolderGone(gone) from None
    found = {}
    for child in children:
        real, name = inside(root, child), printable(child.name)  # JSON holds no byte that is not UTF-8: '\\xe9'
        if real is None or not is_run(root, real):
            continue
        if name in found:  # b'caf\\xe9' beside a folder named 'caf\\xe9'
            warnings.warn(f"{child}: not served, as another run is served as {name}", stacklevel=2)
            continue
        found[name] = Source(name, real, root)
    return found
