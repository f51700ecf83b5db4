"""Checks made before a command writes: an output folder or file whose writing would destroy data (what the command
reads, a run, a non-empty folder without --force) is refused in one line, before any work; and the lock that keeps
a second process out of a folder in use."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from gptforge.errors import GptforgeError, first_detail
from gptforge.files import LOCK, RUN_MARKS, current_folder, is_empty_dir, refuse_non_folder, refuse_special


def check_output_dir(
    out: str | Path,
    force: bool,
    reads: Iterable[str | Path] = (),
    flag: str = "--out",
    *,
    writes_runs: bool = False,
    is_run: bool = False,
) -> None:
    """Refuse an output folder whose writing would destroy data: the folder a command reads from, a parent of it or
    a folder inside it, a gptforge run (unless the command writes one there: `is_run`) or a folder holding one in
    a subfolder (unless the command `writes_runs` there itself), or any existing non-empty folder unless `force`
    names it for replacement."""
    out = output_folder(out, flag)
    target = resolved_path(out, flag)
    _refuse_unreachable(out, flag)
    for source in reads:
        resolved = resolved_path(source, "")
        if resolved == target or target in resolved.parents:
            how = "is" if resolved == target else "contains"
            raise GptforgeError(f"{flag} {out}: {how} {source}, which this command reads; write somewhere else")
        if resolved in target.parents:  # a run inside its data folder: a later prepare --force would delete it
            raise GptforgeError(f"{flag} {out}: inside {source}, which this command reads; write somewhere else")
    refuse_non_folder(out, flag)
    if force and not is_empty_dir(out) and target in current_folder().parents:
        raise GptforgeError(
            f"{flag} {out}: holds the current folder, which replacing it would delete; write elsewhere, or run from "
            "outside it"
        )
    if not is_run and _is_run(out):
        raise GptforgeError(
            f"{flag} {out}: is a gptforge run or checkpoint, which replacing the folder would delete; write elsewhere"
        )
    run = None if writes_runs else _run_inside(out)
    if run is not None:
        raise GptforgeError(
            f"{flag} {out}: holds a gptforge run or checkpoint ({run}), which replacing the folder would delete; "
            "move it out first"
        )
    if not force and not is_empty_dir(out):
        raise GptforgeError(
            f"{flag} {out}: exists and is not empty; pick another folder, or pass --force to replace it "
            "(the old folder is removed only once the new one is complete)"
        )


def output_folder(out: str | Path, flag: str = "--out") -> Path:
    """`out` as a Path, or one line for an empty name (Path('') would be the current folder)."""
    if not str(out).strip():
        raise GptforgeError(f"{flag} {str(out)!r}: empty (expected a folder name)")
    return Path(out)


def resolved_path(path: str | Path, flag: str) -> Path:
    """`path` made absolute with its links followed, or one line naming a loop of symbolic links."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:  # Python 3.11 says "Symlink loop" with a RuntimeError, 3.13 an OSError
        raise GptforgeError(f"{flag} {path}".strip() + f": cannot be followed ({first_detail(e)})") from None


def _refuse_unreachable(out: Path, flag: str) -> None:
    """One line for an output folder that cannot be made: a link to nothing, or a file where a parent folder goes."""
    if out.is_symlink() and not out.exists():
        raise GptforgeError(f"{flag} {out}: a symbolic link to {os.readlink(out)}, which does not exist")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise GptforgeError(f"{flag} {out}: {parent} is a file, not a folder")


def _is_run(folder: Path) -> bool:
    """True for a run's folder (its log or checkpoints/) or a checkpoint's own (its meta.json)."""
    return folder.is_dir() and any((folder / mark).exists() for mark in RUN_MARKS)


def _run_inside(folder: Path) -> Path | None:
    """A gptforge run or checkpoint one to three levels below `folder` (a run's checkpoints are not other runs)."""
    own = folder / "checkpoints" if _is_run(folder) else None
    marks = (folder.glob(f"{depth}{mark}") for depth in ("*/", "*/*/", "*/*/*/") for mark in RUN_MARKS)
    found = (p.parent for p in itertools.chain.from_iterable(marks) if own is None or own not in p.parents)
    return next(found, None)


def check_output_file(out: str | Path, force: bool, reads: Iterable[str | Path] = (), flag: str = "--out") -> None:
    """Refuse an output file path ending in a slash (a folder's), inside a folder the command reads (always), a
    folder, a device, FIFO or socket, one whose folder is missing, or one that exists (a dangling link too) without
    `force`."""
    if not str(out).strip():  # Path('') would be the current folder
        raise GptforgeError(f"{flag} {str(out)!r}: empty (expected a file name)")
    if str(out).endswith(("/", os.sep)):  # Path() would drop the slash and write a file of the folder's name
        raise GptforgeError(f"{flag} {out}: ends in a slash, so names a folder (expected a file name)")
    out = Path(out)
    refuse_special(out, f"{flag} {out}")
    for source in reads:
        if resolved_path(source, "") in resolved_path(out, flag).parents:
            raise GptforgeError(f"{flag} {out}: inside {source}, which this command reads; write somewhere else")
    if out.is_dir():
        raise GptforgeError(f"{flag} {out}: is a folder (expected a file name to write)")
    if not out.parent.is_dir():
        raise GptforgeError(f"{flag} {out}: no folder {out.parent} to write it in")
    if (out.exists() or out.is_symlink()) and not force:
        raise GptforgeError(
            f"{flag} {out}: exists; pick another name, or pass --force to replace it "
            "(the old file is replaced only once the new one is complete)"
        )


_held: set[Path] = set()


@contextlib.contextmanager
def locked(folder: str | Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (created if missing) for the block; a second holder gets one line
    naming this process. The OS releases the lock when the process dies, so a kill -9 leaves nothing stale."""
    folder = Path(folder)
    refuse_non_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _held:  # this process holds it already (the demo, then the training it runs)
        yield
        return
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, job = os.pread(fd, 64, 0).decode(errors="replace").strip().partition(" ")
            raise GptforgeError(
                f"{folder}: in use by another gptforge {job or what} (pid {pid or 'unknown'}); "
                "wait for it to end or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
        _held.add(key)
        yield
    finally:
        _held.discard(key)
        os.close(fd)
