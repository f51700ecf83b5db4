"""The life of a `prepare` output folder: where to build (in place, resumed, or beside it and swapped in),
its lock, the temp files a kill left, and the progress marker that says it is unfinished."""

from __future__ import annotations

import contextlib
import errno
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.report import REMOVED_FILE
from gptforge.data.shards import MANIFEST, PROGRESS
from gptforge.errors import GptforgeError
from gptforge.files import atomic_write, is_empty_dir, stale_temp_files, temp_dir_for, temp_dir_path
from gptforge.outputs import check_output_dir, locked

TOKENIZER_FILE = "tokenizer.json"
REPORT_FILE = "report.md"
# Errors of the disk being written, not of the source being read (a network drop is not "cannot write").
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM}
# What the messages of errors that the same command resumes from say (files.writing's, the engine's, prepare's).
RESUMABLE = ("cannot write", "run the same command again")
# The files prepare writes (atomic_write leaves a temp file of one when killed mid-write).
OWN_FILES = "|".join(map(re.escape, (MANIFEST, PROGRESS, TOKENIZER_FILE, REPORT_FILE, REMOVED_FILE)))
OWN_FILES += r"|(train|val)_\d+\.bin"


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None for a missing, unreadable or malformed file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None
    return value if isinstance(value, dict) else None


def read_own(path: Path) -> dict[str, Any] | None:
    """A manifest.json or progress.json that a text `prepare` wrote (its "settings" and "shards"), else None: a file
    of the same name from anyone else must not make the folder look like ours, whose files we may delete."""
    value = read_json(path)
    ours = value is not None and isinstance(value.get("settings"), dict) and isinstance(value.get("shards"), list)
    return value if ours else None


def holds_own_data(out: Path) -> bool:
    """Whether `out` holds a text prepare's data, finished or not."""
    return read_own(out / MANIFEST) is not None or read_own(out / PROGRESS) is not None


def finished(out: Path, settings: PrepareSettings) -> dict[str, Any] | None:
    """The manifest of `out` when it already holds data prepared with `settings`."""
    done = read_own(out / MANIFEST)
    return done if done is not None and settings.matches(done.get("settings")) else None


@contextlib.contextmanager
def marked_if_failed(folder: Path) -> Iterator[None]:
    """An error (not a kill, Ctrl-C or full disk, which the same command resumes) marks the folder's progress.json
    failed: a corrected command with other settings may then start over there without --force."""
    try:
        yield
    except GptforgeError:
        progress = read_json(folder / PROGRESS)
        if progress is not None:
            atomic_write(folder / PROGRESS, json.dumps({**progress, "failed": True}))
        raise


@contextlib.contextmanager
def removed_if_failed(out: Path, created: bool) -> Iterator[None]:
    """Remove `out` on an error when this command `created` it, so a refused corpus leaves nothing behind; an error
    the same command resumes from (RESUMABLE: a full disk, Slurm tasks still running) and an older folder are left."""
    try:
        yield
    except GptforgeError as e:
        if created and not any(said in str(e) for said in RESUMABLE):
            shutil.rmtree(out, ignore_errors=True)
        raise


def already_prepared(out: Path, manifest: dict[str, Any], lock: Any = locked) -> dict[str, Any]:
    """Say so and return `manifest`, tidying what a killed run left if the folder can be written and locked."""
    print(f"{out}: already prepared with these settings", flush=True)
    with contextlib.suppress(OSError, GptforgeError), lock(out, "prepare"):  # read-only, or in use: leave it
        (out / PROGRESS).unlink(missing_ok=True)  # left by a kill between the manifest and its removal
        remove_stale_temps(out)
    return manifest


def remove_stale_temps(folder: Path) -> None:
    """Delete the temp files of prepare's own files that a kill -9 mid-write left; only with the lock held, so
    no other prepare is writing them."""
    for path in stale_temp_files(folder, OWN_FILES):
        path.unlink(missing_ok=True)


def remove_own_files(folder: Path) -> None:
    """Delete the files a superseded unfinished prepare wrote (shards, tokenizer, progress); nothing else."""
    for path in folder.iterdir():
        if re.fullmatch(OWN_FILES, path.name) and path.is_file():
            path.unlink()


def destination(out: Path, settings: PrepareSettings, force: bool) -> Path | None:
    """Where to build: `out` itself (empty, or an unfinished prepare to resume), a folder beside it that
    replaces it once complete (--force), or None when `out` already holds this data."""
    done, progress = read_own(out / MANIFEST), read_own(out / PROGRESS)
    if done is not None and settings.matches(done.get("settings")) and not force:
        return None
    if done is None and progress is not None and _resumable(progress, settings):
        return out  # resume; or start over, as nothing was written yet or that attempt failed
    if is_empty_dir(out):
        return out
    if done is None and progress is None:
        check_output_dir(out, force)  # a folder that is not gptforge data: replaced only with --force
    refuse_other_settings(out, settings, force)
    unfinished = read_own(temp_dir_path(out) / PROGRESS)
    if unfinished is not None and settings.matches(unfinished.get("settings")):
        return temp_dir_path(out)  # a killed --force run resumes
    return temp_dir_for(out)


def refuse_other_settings(out: Path, settings: PrepareSettings, force: bool) -> None:
    """One line when `out` holds data (or an unfinished prepare) of other settings and --force is not given; checked
    before the costly work too (the classifier reads the whole corpus first), and nothing is written."""
    done, progress = read_own(out / MANIFEST), read_own(out / PROGRESS)
    prior = done or progress
    if force or prior is None or settings.matches(prior.get("settings")):
        return
    if done is None and _resumable(progress, settings):
        return
    saved = prior.get("settings")
    differs = settings.difference(saved if isinstance(saved, dict) else {})
    raise GptforgeError(
        f"{out}: holds {'data prepared' if done else 'an unfinished prepare'} with other settings ({differs}); "
        "pass --force to replace it (the old data stays until the new is complete), or pick another --out"
    )


def _resumable(progress: dict[str, Any], settings: PrepareSettings) -> bool:
    """An unfinished prepare that this one continues (same settings) or starts over: one that wrote no shard yet,
    or failed with an error (whose corrected command has other settings)."""
    return settings.matches(progress.get("settings")) or not progress.get("shards") or bool(progress.get("failed"))
