"""Writing so that nothing is ever half-written: a file (`atomic_write`) or a folder (`building_dir`, `swap_dir`)
appears whole or not at all; append-only logs (`append_jsonl`) can lose at most their last line.

Checkpoints and exports write their files with their own libraries (safetensors, torch.save) into a temporary
folder from here, which is swapped in only once complete. Reading the user's files is `inputs`'s job.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import math
import os
import re
import resource
import secrets
import shutil
import signal
import stat
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from gptforge.errors import GptforgeError, first_detail


def atomic_write(path: str | Path, data: str | bytes | Iterable[bytes | memoryview]) -> Path:
    """Write to a temp file beside `path`, fsync, then rename: readers see the old file or the new one."""
    path = Path(path)
    refuse_special(path, f"cannot write {path}")
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")  # one writer per process; see stale_temp_files
    chunks = [data.encode()] if isinstance(data, str) else [data] if isinstance(data, bytes) else data
    try:
        with writing(path):  # the rename too: a folder in the way is a write that failed
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # a read-only folder refuses even this; the write's error stands
            tmp.unlink(missing_ok=True)
    return path


def to_json(value: Any, indent: int | None = None) -> str:
    """Strict JSON: a non-finite float (a diverged loss, an empty mean) is written as null, never as NaN."""
    return json.dumps(_finite(value), indent=indent, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def usual_mode(path: Path) -> Path:
    """Give a file the permissions `open` would (safetensors creates its files readable by the owner only)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    return path


def stale_temp_files(folder: Path, names: str) -> list[Path]:
    """The temp files a killed `atomic_write` left in `folder` for files whose names match the regex `names`."""
    pattern = re.compile(rf"\.({names})\.tmp\.\d+")
    return [p for p in folder.iterdir() if pattern.fullmatch(p.name)]


def write_json(path: str | Path, value: Any) -> Path:
    return atomic_write(path, to_json(value, indent=2))


def named(path: str | Path) -> Path:
    """`path`, or for '.' and '..' (no name of their own) and any way to the current folder (a link to it, a link
    inside it) the real folder they mean: a sibling is named after it. Other links are not followed: a link is
    replaced as a link."""
    path = Path(path)
    return path.resolve() if path.name in ("", "..") or _is_current_folder(path) else path


def temp_dir_path(final: Path) -> Path:
    """Where `final`'s replacement is built: a hidden folder beside it, so the rename stays on one filesystem. The
    name is fixed (a killed run, and every rank, finds it) and says gptforge, so no user folder is taken for it."""
    final = named(final)
    return final.with_name(f".{final.name}.gptforge-tmp")


def temp_dir_for(final: Path) -> Path:
    """A fresh `temp_dir_path(final)` (a crash's leftover is cleared). Old contents a kill -9 stranded mid-swap stop
    the write (replacing `final` again would lose what stayed in it) until the user sorts them out; an empty
    stranded folder is removed."""
    for old in leftovers(final):
        with contextlib.suppress(OSError):
            old.rmdir()
        if old.exists():
            raise GptforgeError(
                f"{old}: old contents of {named(final).name} that a gptforge killed while replacing it left (the rest "
                "may still be in it); move back what you need and delete this folder, then run again"
            )
    tmp = temp_dir_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def refuse_special(path: Path, what: str) -> None:
    """Refuse a device, FIFO or socket (or a link to one) where a file is to be written: replacing it by rename
    would, as root, turn /dev/null into a regular file."""
    try:
        mode = path.stat().st_mode
    except OSError:  # missing, or a dangling link: nothing special to spare
        return
    kinds = {stat.S_ISCHR: "a device", stat.S_ISBLK: "a device", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
    kind = next((name for test, name in kinds.items() if test(mode)), None)
    if kind:
        raise GptforgeError(f"{what}: it is {kind}, not a file (gptforge writes only files and folders it may replace)")


def refuse_non_folder(final: Path, flag: str = "") -> None:
    if final.exists() and not final.is_dir():
        where = f"{flag} {final}".strip()
        raise GptforgeError(f"{where}: exists and is not a folder (expected a folder to write or replace)")


def swap_dir(tmp: Path, final: Path) -> Path:
    """Put the complete folder `tmp` at `final`; an old `final` is moved aside first and deleted only after."""
    refuse_non_folder(final)
    with uninterrupted():
        if final.exists() and _is_current_folder(final):
            _swap_entries(tmp, final)
        elif final.exists():
            final = named(final)
            old = _aside(final)
            final.rename(old)
            try:
                tmp.rename(final)
            except OSError:
                old.rename(final)
                raise
            old.unlink() if old.is_symlink() else shutil.rmtree(old)  # a link is replaced, what it points to kept
        else:
            tmp.rename(final)
    return final


def _aside(final: Path) -> Path:
    """Where `final`'s old contents wait until the new ones are in: a name no one else holds (a fixed one could be
    a folder of the user's, which would be deleted) that `leftovers` finds if a kill -9 leaves it."""
    return final.with_name(f".{final.name}{OLD_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def leftovers(final: Path) -> list[Path]:
    """Old contents of `final` left beside it by a gptforge killed midway through replacing it (kill -9): those
    whose process is gone (a live one is still swapping)."""
    final = named(final)
    found = final.parent.glob(f".{glob.escape(final.name)}{OLD_MARK}*") if final.parent.is_dir() else []
    return sorted(p for p in found if not _running(p.name.rpartition(OLD_MARK)[2].partition("-")[0]))


def _running(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, OverflowError, ProcessLookupError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP off for a block of renames that must not be split (a signal between a rename
    and its record would strand an entry); a signal that came is delivered once the block is done."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if caught:
            signal.raise_signal(caught[0])


def current_folder() -> Path:
    try:
        return Path.cwd().resolve()
    except OSError:  # the current folder is gone
        return Path("/nonexistent-current-folder")


def _is_current_folder(folder: Path) -> bool:
    try:
        return folder.resolve() == current_folder()
    except OSError:
        return False


def _swap_entries(tmp: Path, final: Path) -> None:
    """Replace the entries of the current folder by `tmp`'s, the folder kept: replaced whole, the shell that
    named it '.' would be left in a deleted folder. The old entries go aside first, deleted only after; an
    interruption midway (Ctrl-C, an error) puts every entry back where it was."""
    final = final.resolve()
    old = _aside(final)
    old.mkdir()
    moved: list[tuple[Path, Path]] = []
    try:
        for entry in [e for e in final.iterdir() if e.name != LOCK]:  # the lock held stays where it is held
            entry.rename(old / entry.name)
            moved.append((old / entry.name, entry))
        for entry in list(tmp.iterdir()):
            entry.rename(final / entry.name)
            moved.append((final / entry.name, entry))
    except BaseException:
        for now, was in reversed(moved):
            now.rename(was)
        old.rmdir()
        raise
    tmp.rmdir()
    shutil.rmtree(old)


@contextlib.contextmanager
def building_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temp folder to fill; on success it replaces `final` with `swap_dir`, on error it is removed."""
    final = Path(final)
    refuse_non_folder(final)  # before any work, and never replace a file with a folder
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_for(final)
    try:
        with writing(final):
            yield tmp
            swap_dir(tmp, final)  # in the try: a signal held off during the swap must not strand `tmp` either
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def replacing_dir(final: Path) -> Iterator[Path]:
    """Yield `final` itself when it is empty (so a run's progress can be watched there), else a temp folder beside it
    that replaces it once the work succeeds: what it held stays until then (a failed attempt's folder is left)."""
    if is_empty_dir(final):
        final.mkdir(parents=True, exist_ok=True)
        yield final
        return
    tmp = temp_dir_for(final)
    yield tmp
    swap_dir(tmp, final)
    print(f"replaced the previous contents of {final}", flush=True)


@contextlib.contextmanager
def writing(target: Path) -> Iterator[None]:
    """Turn a failed write into one line naming `target`. Libraries that write for us (safetensors, torch.save)
    report a full disk, or a file grown past the largest size allowed, in their own words, so their errors are
    read as one of these when the words or the disk say so."""
    try:
        yield
    except (GptforgeError, KeyboardInterrupt):
        raise
    except OSError as e:
        temp = e.filename and any(t in str(e.filename) for t in (".tmp", ".gptforge-tmp"))
        where = e.filename if e.filename and not temp else target  # not our temp names
        if e.errno is None and _too_large(target, e):  # numpy's short write: "N requested and M written"
            raise GptforgeError(f"cannot write {where}: File too large ({e}); {_size_cap()}") from None
        if e.errno is None and _disk_full(target, e):
            raise GptforgeError(f"cannot write {where}: No space left on device ({e})") from None
        cap = f"; {_size_cap()}" if e.errno == errno.EFBIG else ""
        raise GptforgeError(f"cannot write {where}: {e.strerror or e}{cap}") from None
    except Exception as e:
        if _too_large(target, e):
            raise GptforgeError(f"cannot write {target}: File too large ({first_detail(e)}); {_size_cap()}") from None
        if not _disk_full(target, e):
            raise
        raise GptforgeError(f"cannot write {target}: No space left on device ({first_detail(e)})") from None


def _disk_full(target: Path, error: Exception) -> bool:
    if "No space left" in str(error) or "os error 28" in str(error):
        return True
    folder = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    return shutil.disk_usage(folder).free < 64 << 20


FAT32_LARGEST = 2**32 - 1
"""The largest file FAT32 holds (4 GiB less a byte): a write past it fails with EFBIG, the file left at this size."""


def _too_large(target: Path, error: Exception) -> bool:
    """Whether a library's failed write met a cap on a file's size (errno EFBIG): its words say so (safetensors), or
    a file being written for `target` stopped at the cap (torch's "unexpected pos" and numpy's short writes)."""
    if "File too large" in str(error) or "os error 27" in str(error):
        return True
    caps = (FAT32_LARGEST, resource.getrlimit(resource.RLIMIT_FSIZE)[0])
    tmp, named_target = temp_dir_path(target), named(target)
    beside = named_target.with_name(f".{named_target.name}.tmp.{os.getpid()}")  # atomic_write's and write_gguf's
    try:
        files = [beside, *(tmp.rglob("*") if tmp.is_dir() else ())]
        return any(p.is_file() and p.stat().st_size in caps for p in files)
    except OSError:  # the folder is unreadable: the library's error stands
        return False


def _size_cap() -> str:
    """What caps a file's size: this process's limit when it has one (`ulimit -f`), else the file system."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f"this process may write files of at most {limit:,} bytes (ulimit -f): raise that limit"
    return (
        "the file system there caps the size of a file (FAT32 at 4 GiB): "
        "write to a drive with another file system (ext4, NTFS, exFAT)"
    )


LOCK = ".lock"
OLD_MARK = ".gptforge-old-"  # in the hidden name of a folder's old contents while a swap replaces them
"""The file `locked` holds in a run or data folder; it does not make the folder non-empty."""
METRICS = "metrics.jsonl"
"""A run's log (rundir): with its checkpoints/ folder, what marks a folder as a gptforge run."""
RUN_MARKS = (METRICS, "checkpoints", "meta.json")  # meta.json: a checkpoint's own folder


def is_empty_dir(path: str | Path) -> bool:
    """True for a missing folder, or one holding nothing but a lock file."""
    path = Path(path)
    return not path.exists() or (path.is_dir() and all(p.name == LOCK for p in path.iterdir()))


def append_jsonl(path: str | Path, record: Any) -> None:
    """Add one line to an append-only log (metrics, samples): a crash can cut only the line being written."""
    with writing(Path(path)):
        cut_torn_tail(Path(path))
        with open(path, "a", encoding="utf-8") as f:
            f.write(to_json(record) + "\n")


def cut_torn_tail(path: Path) -> None:
    """Drop a last line a crash left without its newline from an append-only log: a line appended to it would tear
    both records, and readers refuse a torn line that is not the last."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        start = end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":  # whole: the usual case costs one byte's read
            return
        while start > 0:
            start = max(0, start - 65536)
            f.seek(start)
            block = f.read(end - start)
            if b"\n" in block:
                f.truncate(start + block.rindex(b"\n") + 1)
                return
        f.truncate(0)
