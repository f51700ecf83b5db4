"""Readers that yield documents as (name, text): the stdlib code corpus, local files, Hugging Face datasets.

Names are stable (relative to the source) because the validation split is chosen by hashing them.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from gptforge.data.languages import CONTAINERS, DEFAULT_EXTENSIONS, decode, is_binary, selects
from gptforge.data.shards import MANIFEST, PROGRESS
from gptforge.errors import GptforgeError
from gptforge.inputs import format_suffix, printable, read_jsonl, read_text, reading

# Files that mark a folder written by `datasets`' save_to_disk (a Dataset's, a DatasetDict's).
SAVED_DATASET = ("state.json", "dataset_dict.json", "dataset_info.json")
# Named sources: (SOURCE, text field). Both stream from the Hugging Face hub.
PRESETS = {
    "fineweb-edu-10b": ("hf:HuggingFaceFW/fineweb-edu:sample-10BT", "text"),
    "codeparrot": ("hf:codeparrot/codeparrot-clean", "content"),
}
Document = tuple[str, str]


def resolve(source: str, text_field: str | None) -> tuple[str, str]:
    """Expand a named preset; the text field defaults to the preset's, else 'text'."""
    if source in PRESETS:
        preset, field = PRESETS[source]
        return preset, text_field or field
    return source, text_field or "text"


def documents(
    source: str,
    text_field: str = "text",
    extensions: frozenset[str] = DEFAULT_EXTENSIONS,
    skipped: list[tuple[str, int, str]] | None = None,
) -> Iterator[Document]:
    """Documents of a `prepare` SOURCE; a missing path fails here, before any work starts. A folder or glob
    reads the files `extensions` selects (languages.py); binary files, and text in no encoding we read, go to
    `skipped` as (name, bytes, 'binary' or 'undecodable') instead (a file named as the source itself that is
    not UTF-8 is an error naming it)."""
    if source == "stdlib":
        return stdlib_documents()
    if source.startswith("hf:"):
        return hf_documents(source[3:], text_field)
    files, named = _files(source, extensions), Path(source).is_file()
    return (doc for path, name in files for doc in _file_documents(path, name, text_field, skipped, strict=named))


def source_bytes(source: str, extensions: frozenset[str] = DEFAULT_EXTENSIONS) -> int | None:
    """Bytes to read when cheaply known (for a progress ETA): the stdlib and uncompressed local files."""
    if source == "stdlib":
        return sum(p.stat().st_size for p in _stdlib_files())
    if source.startswith("hf:"):
        return None
    files = [p for p, _ in _files(source, extensions)]
    return None if any(p.suffix in (".gz", ".parquet") for p in files) else sum(p.stat().st_size for p in files)


def source_state(source: str, extensions: frozenset[str] = DEFAULT_EXTENSIONS) -> tuple[int, int, str] | None:
    """(files, bytes, digest of each file's name, size and modification time) of a local SOURCE, to tell a folder
    prepared from an earlier state of it; None for a dataset (hf:), whose changes are not seen."""
    if source.startswith("hf:"):
        return None
    root = Path(sysconfig.get_paths()["stdlib"]) if source == "stdlib" else None
    files = [(p, p.relative_to(root).as_posix()) for p in _stdlib_files()] if root else _files(source, extensions)
    digest, total = hashlib.sha256(), 0
    for path, name in files:
        stat = path.stat()
        total += stat.st_size
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode("utf-8", "surrogatepass"))
    return len(files), total, digest.hexdigest()


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        p for p in sorted(root.rglob("*.py")) if p.relative_to(root).parts[0] not in ("site-packages", "dist-packages")
    ]


def stdlib_documents() -> Iterator[Document]:
    """Every .py file of the running interpreter's standard library (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files():
        rel = path.relative_to(root)
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of test fixtures are deliberately not UTF-8
        yield f"stdlib/{rel.as_posix()}", text


def _glob_root(pattern: str) -> tuple[str, str]:
    """A glob split into its literal leading folder and the rest: 'data/*/x.txt' -> ('data', '*/x.txt')."""
    parts = pattern.split("/")
    literal = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    return "/".join(parts[:literal]) or ("/" if pattern.startswith("/") else ""), "/".join(parts[literal:])


def local_paths(source: str) -> list[Path]:
    """The files or folders on this machine that a SOURCE reads (a glob: its literal leading folder)."""
    if source == "stdlib":
        return []
    if source.startswith("hf:"):
        local = Path(source[3:].partition(":")[0])  # hf: also takes a local dataset folder
        return [local] if local.exists() else []
    return [Path(_glob_root(source)[0] or ".")] if glob.has_magic(source) else [Path(source)]


def _files(source: str, extensions: frozenset[str] = DEFAULT_EXTENSIONS) -> list[tuple[Path, str]]:
    """(path, stable printable name) of the files a path, folder or glob names, sorted; a file reached twice
    (through symlinks) is read once. Neither form descends into symlinked folders, so a symlink loop ends."""
    root = Path(source)
    if glob.has_magic(source):
        named = [(p, p.as_posix()) for p in _glob(source)]
    elif root.is_file():
        named = [(root, root.name)]
    elif root.is_dir():
        named = [(p, p.relative_to(root).as_posix()) for p in root.rglob("*")]
    elif root.exists():
        raise GptforgeError(f"{source}: not a regular file or folder (a FIFO, socket or device is not a corpus)")
    elif root.is_symlink():
        raise GptforgeError(f"{source}: a link to {os.readlink(root)}, which does not exist")
    else:
        raise GptforgeError(f"{source}: no such file or directory (expected 'stdlib', hf:NAME, a file, folder or glob)")
    ours = {p.parent for p, _ in named if p.name in (MANIFEST, PROGRESS) and is_data_folder(p.parent)}
    named = [(p, n) for p, n in named if not any(d in p.parents for d in ours if d != root)]
    files, seen = [], set()
    for path, name in sorted(named):
        suffix = format_suffix(path)
        container = suffix in CONTAINERS and (suffix in extensions or extensions == DEFAULT_EXTENSIONS)
        read = container or selects(path.name, extensions)
        if read and path.is_file() and path.resolve() not in seen:
            seen.add(path.resolve())
            files.append((path, printable(name)))  # a name reaches report.md and removed.jsonl: UTF-8 only
    if not files:
        raise GptforgeError(_nothing_to_read(source, [p for p, _ in named if p.is_file()]))
    return files


def is_data_folder(folder: Path) -> bool:
    """Whether `prepare` wrote `folder` (its manifest or progress file names the settings): its report.md and
    tokenizer.json are not a corpus, so a data folder inside a source is not read."""
    for marker in (MANIFEST, PROGRESS):
        try:
            value = json.loads((folder / marker).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(value, dict) and isinstance(value.get("settings"), dict) and "source" in value["settings"]:
            return True
    return False


def _nothing_to_read(source: str, found: list[Path]) -> str:
    """Why a path, folder or glob gives no file to read: a saved dataset (read with hf:), or which kinds it holds."""
    expected = "expected source or text files (gptforge/data/languages.py, see --ext), .jsonl or .parquet"
    if any((Path(source) / marker).is_file() for marker in SAVED_DATASET) and not glob.has_magic(source):
        return f"{source}: a folder written by datasets' save_to_disk; read it as hf:{source}"
    if not found:
        return f"{source}: no files {'match' if glob.has_magic(source) else 'in it'} ({expected})"
    kinds = Counter(format_suffix(p) or "no extension" for p in found).most_common()
    shown = ", ".join(f"{n} {kind}" for kind, n in kinds[:5]) + (", ..." if len(kinds) > 5 else "")
    return f"{source}: no file of a kind prepare reads ({expected}; found {shown})"


def _glob(pattern: str) -> list[Path]:
    """Paths matching `pattern`, by pathlib: its `**` stays out of symlinked folders, where glob.glob follows
    a symlink loop until the OS stops it. Hidden names match only a pattern part starting with '.', as in glob."""
    prefix, rest = _glob_root(pattern)
    if rest.split("/")[-1] == "**":  # pathlib's '**' matches folders only; glob.glob's also their files
        rest += "/*"
    base = Path(prefix or ".")
    hidden_ok = any(part.startswith(".") for part in rest.split("/"))
    try:
        matches = list(base.glob(rest))
    except ValueError as e:  # pathlib refuses some patterns glob.glob takes, like 'a**'
        raise GptforgeError(f"{pattern}: not a supported glob ({e})") from None
    return [p for p in matches if hidden_ok or not any(x.startswith(".") for x in p.relative_to(base).parts)]


def _file_documents(
    path: Path, name: str, text_field: str, skipped: list[tuple[str, int, str]] | None = None, strict: bool = True
) -> Iterator[Document]:
    kind = format_suffix(path)
    if kind == ".parquet":
        with reading(path):
            yield from _parquet_documents(path, name, text_field)
    elif kind == ".jsonl":
        for where, record in read_jsonl(path):
            yield f"{name}:{where.rsplit(':', 1)[1]}", _json_text(record, text_field, where)
    else:
        with reading(path):
            data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = decode(data)
        why = "binary" if is_binary(data) else "undecodable"
        if text is None and why == "undecodable" and strict:
            text = read_text(path)  # the source itself in no encoding we read: one line naming it
        if text is None:  # binary by content whatever its name, or one undecodable file of many
            if skipped is not None:
                skipped.append((name, len(data), why))
            return
        yield name, text


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _json_text(record, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        found = (
            f"an object without it (its keys: {', '.join(map(repr, list(record)[:5]))})"
            if isinstance(record, dict)
            else f"a JSON {_JSON_KINDS.get(type(record), type(record).__name__)}"
        )
        chat = isinstance(record, dict) and ("messages" in record or "instruction" in record)
        hint = "; conversations? use --chat" if chat else ""
        raise GptforgeError(f"{where}: expected a JSON object with a string field {text_field!r}, found {found}{hint}")
    text = record[text_field]
    if text is None:  # as parquet and hf: read a null: an empty document, counted in the report
        return ""
    if not isinstance(text, str):
        raise GptforgeError(f"{where}: field {text_field!r} is {type(text).__name__}, expected a string")
    if not text.isascii():  # JSON's \ud800 escapes make lone surrogates, which no tokenizer can encode
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise GptforgeError(
                f"{where}: field {text_field!r} holds a lone surrogate \\u{ord(text[e.start]):04x} (not text)"
            ) from None
    return text


def _parquet_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    """Rows of one column, read a batch at a time (bounded memory)."""
    try:
        import pyarrow.parquet as pq
        import pyarrow.types as pa_types
    except ImportError:
        raise GptforgeError(f"{path}: reading parquet needs pyarrow (pip install 'gptforge[hf]')") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise GptforgeError(f"{path}: not a readable parquet file ({e})") from None
    if text_field not in parquet.schema_arrow.names:
        raise GptforgeError(
            f"{path}: no column {text_field!r} (columns: {parquet.schema_arrow.names}; see --text-field)"
        )
    kind = parquet.schema_arrow.field(text_field).type
    if not (pa_types.is_string(kind) or pa_types.is_large_string(kind) or pa_types.is_null(kind)):
        raise GptforgeError(f"{path}: column {text_field!r} is {kind}, expected strings")
    row = 0
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield f"{name}:{row}", text or ""
            row += 1


def open_hf_dataset(spec: str, split: str, where: str) -> Iterator[dict]:
    """Rows of `NAME[:CONFIG]`'s split from the Hugging Face hub (or a local dataset folder), streamed."""
    try:
        import datasets
    except ImportError:
        raise GptforgeError(f"{where}: needs the datasets library (pip install 'gptforge[hf]')") from None
    name, _, config = spec.partition(":")
    saved = Path(name)
    if (saved / "state.json").is_file() or (saved / "dataset_dict.json").is_file():
        return _saved_dataset(datasets, saved, split, where)
    try:
        return datasets.load_dataset(name, config or None, split=split, streaming=True)
    except Exception as e:  # datasets raises many types (offline, missing config, unknown dataset)
        raise GptforgeError(f"{where}: cannot open the dataset ({type(e).__name__}: {e})") from None


def _saved_dataset(datasets, folder: Path, split: str, where: str):
    """A folder written by `Dataset.save_to_disk` (or a DatasetDict's, whose `split` is taken), memory-mapped."""
    try:
        saved = datasets.load_from_disk(str(folder))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a damaged folder
        raise GptforgeError(f"{where}: cannot load the saved dataset ({type(e).__name__}: {e})") from None
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise GptforgeError(f"{where}: the saved dataset has no {split!r} split (it has {sorted(saved)})")
        saved = saved[split]
    return saved


def hf_documents(spec: str, text_field: str) -> Iterator[Document]:
    """`NAME[:CONFIG]` from the Hugging Face hub (or a local dataset folder), streamed: nothing is downloaded whole."""
    name = spec.partition(":")[0]
    stream = open_hf_dataset(spec, "train", f"hf:{spec}")
    for i, row in enumerate(stream):
        if text_field not in row:
            raise GptforgeError(f"hf:{spec}: no field {text_field!r} (fields: {sorted(row)}; see --text-field)")
        yield f"{name}:{i}", row[text_field] or ""
