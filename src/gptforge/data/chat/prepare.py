"""`gptforge prepare SOURCE --chat`: JSONL conversations -> token shards, a loss mask beside each, a manifest.

Each row is one conversation, in OpenAI's form or Alpaca's (`tokens.chat`). A bad row is skipped, counted and
named (`file:line`) in report.md. Conversations are de-duplicated (exact and MinHash, on their text), decontaminated
and split whole; a row may name its split (`"split": "val"`), else a stable hash of its text decides. Each
conversation is followed by EOT (outside the loss), so a loader finds where one ends as in any data folder.
"""

from __future__ import annotations

import glob
import hashlib
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptforge.data.clean.decontaminate import eval_ngrams, is_contaminated
from gptforge.data.clean.dedup import Deduplicator, DedupSettings, Fingerprint, fingerprint
from gptforge.data.pipeline import is_validation
from gptforge.data.prepare_settings import check_dedup
from gptforge.data.report import REMOVED_FILE, removal
from gptforge.data.shards import MASK_SUFFIX, SPLITS, dtype_for_vocab, write_manifest, write_mask, write_shard
from gptforge.data.sources import is_data_folder
from gptforge.errors import GptforgeError
from gptforge.files import atomic_write, building_dir
from gptforge.inputs import not_utf8, open_jsonl, parse_json, printable, reading
from gptforge.outputs import check_output_dir, locked, output_folder
from gptforge.tokens.chat import (
    CHAT_TEXTS,
    TEMPLATE_NAME,
    ConversationError,
    Message,
    conversation_from_row,
    format_chat,
    with_chat,
)
from gptforge.tokens.tokenizer import load_tokenizer

SHOWN_BAD_ROWS = 20


@dataclass(frozen=True)
class ChatSettings:
    """What `prepare --chat` makes of its source: the tokenizer ('gpt2' or a tokenizer file), the held-out share,
    de-duplication and decontamination."""

    tokenizer: str = "gpt2"
    val_fraction: float = 0.01
    seed: int = 0
    dedup: DedupSettings = field(default_factory=DedupSettings)
    decontaminate: tuple[str, ...] = ()
    shard_tokens: int = 100_000_000

    def checked(self) -> ChatSettings:
        """These settings, or one line naming the flag whose value cannot work (as the documents' path checks)."""
        check_dedup(self.dedup)
        if not 0 <= self.val_fraction < 1:
            raise GptforgeError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.shard_tokens <= 0:
            raise GptforgeError(f"--shard-tokens must be positive, got {self.shard_tokens}")
        return self


@dataclass
class _Split:
    ids: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    docs: int = 0
    bytes: int = 0
    reply_bytes: int = 0


@dataclass
class ChatCounts:
    rows: int = 0
    kept: int = 0
    bad: Counter = field(default_factory=Counter)
    bad_rows: list[str] = field(default_factory=list)
    removed: Counter = field(default_factory=Counter)
    removed_rows: list[str] = field(default_factory=list)
    trace: list[bytes] = field(default_factory=list)  # removed.jsonl's rows: every bad or removed row


def chat_files(source: str) -> list[Path]:
    """The JSONL files a SOURCE names: a file, a folder's *.jsonl[.gz] files or a glob, sorted."""
    root = Path(source)
    if glob.has_magic(source):
        found = [Path(p) for p in sorted(glob.glob(source, recursive=True)) if Path(p).is_file()]
    elif root.is_dir():
        found = sorted(p for p in root.rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz")) and p.is_file())
    elif root.is_file():
        return [root]
    elif root.exists():
        raise GptforgeError(f"{source}: not a regular file or folder (a FIFO, socket or device is not a corpus)")
    else:
        raise GptforgeError(f"{source}: no such file or folder (expected JSONL conversations)")
    # A data folder inside (an earlier --out there): its removed.jsonl lists removals, not conversations.
    files = [p for p in found if not is_data_folder(p.parent)]
    if not files:
        raise GptforgeError(f"{source}: no .jsonl files of conversations in it")
    return files


def chat_form(source: str) -> str | None:
    """The conversation form a SOURCE's first row is in ('OpenAI messages' or 'Alpaca rows'), or None: how
    `prepare` tells conversations from documents without --chat."""
    try:
        files = chat_files(source)
    except GptforgeError:
        return None
    with reading(files[0]), open_jsonl(files[0]) as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = parse_json(first)
    except ValueError:  # not conversations
        return None
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        return "OpenAI messages"
    if isinstance(row, dict) and {"instruction", "output"} <= row.keys():
        return "Alpaca rows"
    return None


def read_conversations(files: list[Path], counts: ChatCounts) -> Iterator[tuple[str, list[Message], str | None]]:
    """(where, messages, the row's own split or None) for each usable row; bad rows are counted and named."""
    for path in files:
        # a byte that is not UTF-8 spoils its row alone: read on, the row named as other bad rows are
        with reading(path), open_jsonl(path, errors="surrogateescape") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                counts.rows += 1
                where = f"{printable(path)}:{lineno}"  # named in report.md and removed.jsonl: UTF-8 only
                if not_utf8(line):
                    _bad(counts, where, not_utf8(line), "not UTF-8")
                    continue
                try:
                    row = parse_json(line)
                    messages = conversation_from_row(row)
                    split = row.get("split")  # a dict: conversation_from_row refused anything else
                    if split is not None and split not in SPLITS:
                        raise ConversationError(f"split {split!r} is not one of {', '.join(SPLITS)}", "split")
                except ValueError as e:
                    _bad(counts, where, str(e), "not JSON")
                    continue
                except ConversationError as e:
                    _bad(counts, where, str(e), e.param)
                    continue
                yield where, messages, split


def _bad(counts: ChatCounts, where: str, reason: str, field: str) -> None:
    counts.bad[re.sub(r"\[\d+\]", "[i]", field)] += 1  # counted by the field at fault, named row by row
    counts.bad_rows.append(f"{where}: {reason}")
    counts.trace.append(removal(where, "bad row", reason=reason))


def prepare_chat(source: str, out: str | Path, settings: ChatSettings, force: bool = False) -> dict[str, Any]:
    """Write the chat data folder `out` from `source`; returns its manifest. Refused in one line when no row is
    usable; `out` is replaced only once the new folder is complete."""
    out = output_folder(out)  # '' is no folder (Path('') would be the current one)
    files = chat_files(source)
    reads = [*files, *settings.decontaminate, *([settings.tokenizer] if settings.tokenizer != "gpt2" else [])]
    check_output_dir(out, force, reads=reads)
    base = load_tokenizer(settings.tokenizer)
    tokenizer = with_chat(base)
    counts, splits = ChatCounts(), {s: _Split() for s in SPLITS}
    dedup = Deduplicator(settings.dedup)
    ngrams = eval_ngrams(settings.decontaminate) if settings.decontaminate else frozenset()
    kept: dict[int, str] = {}
    for index, (where, messages, split) in enumerate(read_conversations(files, counts)):
        text = "".join(f"{m.role}\n{m.content}\n" for m in messages)
        if ngrams and is_contaminated(text, ngrams):  # before de-duplication: no copy names it as the one kept
            counts.removed["contaminated"] += 1
            counts.removed_rows.append(f"{where}: shares a 13-gram with the evaluation files")
            counts.trace.append(removal(where, "contaminated"))
            continue
        verdict = dedup.check(index, _fingerprint(messages, settings.dedup))
        if verdict is not None:
            counts.removed[f"{verdict.kind} duplicate"] += 1
            counts.removed_rows.append(f"{where}: {verdict.kind} duplicate of {kept[verdict.of]}")
            jaccard = round(verdict.similarity, 4)
            counts.trace.append(removal(where, f"{verdict.kind} duplicate", kept=kept[verdict.of], jaccard=jaccard))
            continue
        kept[index] = where
        key = hashlib.sha256(text.encode()).hexdigest()
        split = split or ("val" if is_validation(key, index, settings.val_fraction, settings.seed) else "train")
        chat = format_chat(tokenizer, messages, add_generation_prompt=False)
        part = splits[split]
        part.ids.append(np.append(chat.ids, tokenizer.eot))
        part.masks.append(np.append(chat.mask, 0).astype(np.uint8))
        part.docs, part.bytes = part.docs + 1, part.bytes + len(text.encode())
        part.reply_bytes += sum(len(m.content.encode()) for m in messages if m.role == "assistant")
        counts.kept += 1
    _check_training_left(source, counts, splits)
    with locked(out, "prepare"), building_dir(out) as tmp:
        check_output_dir(out, force, reads=reads)  # again, holding the lock: another prepare may have written it
        removed = {**{f"bad rows ({k})": v for k, v in counts.bad.items()}, **counts.removed}
        shown = printable(source)  # a name that is not UTF-8 goes into the manifest and report.md escaped
        manifest = _write(tmp, shown, base, splits, settings, removed, sha256=sources_sha256(files))
        atomic_write(tmp / REMOVED_FILE, counts.trace)
        atomic_write(tmp / "report.md", _report(shown, counts, manifest))
    return manifest


def sources_sha256(files: list[Path]) -> str:
    """One digest of the source files' bytes, in order: what a prepared folder was made from, to compare with."""
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _fingerprint(messages: list[Message], settings: DedupSettings) -> Fingerprint:
    """Exact copies compare every turn, each field kept apart; near copies compare what the user asked and what
    the assistant replied: a long system message shared by distinct conversations does not make them copies."""
    exact = "\x1e".join(f"{m.role}\x1f{m.content}" for m in messages)
    turns = "\n".join(m.content for m in messages if m.role != "system")
    near = fingerprint(turns, settings)
    return Fingerprint(fingerprint(exact, settings).key, near.signature, near.shingles)


def _check_training_left(source: str, counts: ChatCounts, splits: dict[str, _Split]) -> None:
    """One line when no conversation is left to train on, saying why (where the rows went: 30 copies leave 1)."""
    if splits["train"].docs:
        return
    gone = {**{f"bad ({k})": v for k, v in counts.bad.items()}, **counts.removed}
    why = f" ({', '.join(f'{v:,} {k}' for k, v in gone.items())})" if gone else ""
    if splits["val"].docs:
        of = f" of {counts.rows:,} rows{why}" if gone else ""
        raise GptforgeError(
            f"{source}: all {splits['val'].docs:,} usable conversations{of} are held out (the first always is, and "
            'rows "split": "val" are); pass --val-fraction 0, or mark rows "split": "train"'
        )
    shown = f"; first bad row: {counts.bad_rows[0]}" if counts.bad_rows else ""
    raise GptforgeError(f"{source}: no usable conversation in {counts.rows:,} rows{why}{shown}")


def _write(
    tmp: Path,
    source: str,
    base,
    splits: dict[str, _Split],
    settings: ChatSettings,
    removed: dict[str, int],
    *,
    sha256: str,
) -> dict[str, Any]:
    dtype = dtype_for_vocab(base.vocab_size + len(CHAT_TEXTS))
    shards, totals = [], {}
    for split, part in splits.items():
        totals[split] = {"docs": part.docs, "bytes": part.bytes, "tokens": int(sum(map(len, part.ids)))}
        totals[split]["assistant_tokens"] = int(sum(int(m.sum()) for m in part.masks))
        totals[split]["assistant_bytes"] = part.reply_bytes  # bits per byte are the replies' own
        for n, (start, end) in enumerate(_shard_ranges(part.ids, settings.shard_tokens)):
            name = f"{split}_{n:06d}"
            ids, mask = np.concatenate(part.ids[start:end]).astype(dtype), np.concatenate(part.masks[start:end])
            shard = {
                "file": f"{name}.bin",
                "split": split,
                "tokens": len(ids),
                "sha256": write_shard(tmp / f"{name}.bin", ids),
            }
            shard.update(docs=end - start, mask=f"{name}{MASK_SUFFIX}")
            shard["mask_sha256"] = write_mask(tmp / shard["mask"], mask)
            shards.append(shard)
    tok = {"name": base.name, "vocab_size": base.vocab_size, "eot": base.eot}
    if base.path is not None:
        shutil.copyfile(base.path, tmp / "tokenizer.json")
        tok["name"] = "tokenizer.json"
    chat = {"template": TEMPLATE_NAME, "special_tokens": list(CHAT_TEXTS)}
    manifest = {
        "source": source,
        "tokenizer": tok,
        "chat": chat,
        "splits": totals,
        "shards": shards,
        "removed": removed,
    }
    manifest["settings"] = {"source": source, "val_fraction": settings.val_fraction, "seed": settings.seed}
    manifest["settings"]["dedup"] = settings.dedup.mode
    manifest["settings"]["sha256"] = sha256  # the source files', to tell a folder made from other rows
    write_manifest(tmp, manifest)
    return manifest


def _shard_ranges(ids: list[np.ndarray], shard_tokens: int) -> Iterator[tuple[int, int]]:
    """Conversation index ranges of about `shard_tokens` tokens each, whole conversations only."""
    start, fill = 0, 0
    for i, conversation in enumerate(ids):
        if fill and fill + len(conversation) > shard_tokens:
            yield start, i
            start, fill = i, 0
        fill += len(conversation)
    if fill:
        yield start, len(ids)


def _report(source: str, counts: ChatCounts, manifest: dict[str, Any]) -> str:
    splits = manifest["splits"]
    lines = [f"# prepare --chat {source}", "", f"{counts.rows:,} rows read, {counts.kept:,} conversations kept", ""]
    lines += ["| split | conversations | tokens | assistant tokens (in the loss) |", "| --- | --- | --- | --- |"]
    for name, s in splits.items():
        share = s["assistant_tokens"] / max(1, s["tokens"])
        lines.append(f"| {name} | {s['docs']:,} | {s['tokens']:,} | {s['assistant_tokens']:,} ({share:.0%}) |")
    removed = {**{f"bad row: {k}": v for k, v in counts.bad.items()}, **counts.removed}
    if removed:
        lines += ["", "| removed | rows |", "| --- | --- |", *(f"| {k} | {v:,} |" for k, v in removed.items())]
    for title, rows in (("Bad rows", counts.bad_rows), ("Removed conversations", counts.removed_rows)):
        if rows:
            shown = f"the first {SHOWN_BAD_ROWS} of {len(rows):,}" if len(rows) > SHOWN_BAD_ROWS else f"{len(rows):,}"
            lines += ["", f"{title} ({shown}):", ""]
            lines += [f"- {row}" for row in rows[:SHOWN_BAD_ROWS]]
    lines += [
        "",
        f"Every bad or removed row is a row of `{REMOVED_FILE}` ({len(counts.trace):,} rows): why, and for a copy the "
        "row kept and the exact Jaccard similarity of their shingles.",
    ]
    return "\n".join(lines) + "\n"
