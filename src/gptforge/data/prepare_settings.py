"""What a `prepare` run was asked to do: one frozen value, saved as the manifest's "settings" object.

A folder is "already prepared" when its saved settings equal these. Keys added after a folder was written
(dedup, clean, ext) are absent from its settings: absence matches the default, so old folders keep working.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptforge.data.clean.dedup import DEDUP_MODES, DedupSettings
from gptforge.data.clean.filters import CleanSettings, build_filters, clean_settings
from gptforge.data.clean.quality import QualitySettings, check_quality
from gptforge.data.languages import DEFAULT_EXTENSIONS, parse_extensions
from gptforge.data.sources import resolve
from gptforge.errors import GptforgeError
from gptforge.tokens.tokenizer import check_vocab_size

# The flag behind each setting, to say which one differs from a folder's.
SETTING_FLAGS = {
    "source": "SOURCE",
    "text_field": "--text-field",
    "tokenizer": "--tokenizer/--train-tokenizer",
    "val_fraction": "--val-fraction",
    "shard_tokens": "--shard-tokens",
    "seed": "--seed",
    "decontaminate": "--decontaminate",
    "ext": "--ext",
    "dedup": "--dedup",
    "clean": "--clean/--clean-set",
    "quality": "--quality/--quality-labels/--quality-threshold",
    "corpus": "SOURCE",
    "tokenizer_sha256": "--tokenizer (the file's sha256)",
}
LATER_KEYS = ("ext", "dedup", "clean", "quality")  # absent from folders prepared before they existed
UNRECORDED = ("corpus", "tokenizer_sha256")  # absent from folders prepared before they existed: nothing to compare
# Past these, MinHash costs grow without finding more copies: a signature's time and memory are linear in the
# hashes (1,000,000 took minutes on 1.7 MB), a shingle's in its words. --dedup-bands divides --dedup-hashes.
MAX_HASHES, MAX_SHINGLE = 1024, 64


@dataclass(frozen=True)
class PrepareSettings:
    source: str
    text_field: str
    val_fraction: float
    shard_tokens: int
    seed: int
    tokenizer: str  # 'gpt2', a file, or 'trained:VOCAB_SIZE'
    decontaminate: tuple[str, ...] = ()
    ext: tuple[str, ...] | None = None  # file types read from a folder or glob; None: languages.DEFAULT_EXTENSIONS
    dedup: DedupSettings = field(default_factory=DedupSettings)
    clean_mode: str = "none"
    clean: CleanSettings = field(default_factory=CleanSettings)
    quality: QualitySettings = field(default_factory=QualitySettings)
    corpus: tuple[int, int, str] | None = None  # sources.source_state: a changed corpus is not already prepared
    tokenizer_sha256: str | None = None  # a --tokenizer file's content: another file of the same name is no resume

    @classmethod
    def from_flags(
        cls,
        source: str,
        *,
        tokenizer: str = "gpt2",
        train_tokenizer: int | None = None,
        val_fraction: float = 0.01,
        shard_tokens: int = 100_000_000,
        text_field: str | None = None,
        decontaminate: Sequence[str] = (),
        seed: int = 0,
        dedup: str | DedupSettings = "near",
        clean: str = "none",
        clean_set: Sequence[str] = (),
        ext: str | None = None,
        quality: QualitySettings | None = None,
    ) -> PrepareSettings:
        """The settings `gptforge prepare`'s flags ask for, each checked (one line naming a flag that cannot work).

        `tokenizer`: 'gpt2' or a tokenizer .json file, or `train_tokenizer=N` for an N-token BPE trained on the
        corpus; `dedup`: a mode (none, exact, near) or its settings; `clean`: a filter set (none, code, web),
        `clean_set` its changes; `ext`: the file types read (languages.parse_extensions); `quality`: the classifier's
        reference and rule."""
        _check_numbers(val_fraction, shard_tokens)
        _check_names(source, tokenizer, decontaminate)
        if train_tokenizer is not None:
            check_vocab_size(train_tokenizer)
            if tokenizer != "gpt2":
                raise GptforgeError(
                    f"--tokenizer {tokenizer} and --train-tokenizer {train_tokenizer}: pass one of them"
                )
        dedup = check_dedup(DedupSettings(mode=dedup) if isinstance(dedup, str) else dedup)
        build_filters(clean)  # an unknown mode fails here
        cleaning = clean_settings(clean_set)
        _check_clean_set(clean, clean_set)
        quality = check_quality(quality or QualitySettings())
        source, text_field = resolve(source, text_field)
        extensions = parse_extensions(ext) if ext is not None else DEFAULT_EXTENSIONS
        return cls(
            source=source,
            text_field=text_field,
            val_fraction=val_fraction,
            shard_tokens=shard_tokens,
            seed=seed,
            tokenizer=f"trained:{train_tokenizer}" if train_tokenizer is not None else tokenizer,
            decontaminate=tuple(sorted(str(p) for p in decontaminate)),
            ext=tuple(sorted(extensions)) if extensions != DEFAULT_EXTENSIONS else None,
            dedup=dedup,
            clean_mode=clean,
            clean=cleaning,
            quality=quality,
        )

    @property
    def trained_vocab(self) -> int | None:
        """N for a BPE trained on the corpus ('trained:N'); None for a given tokenizer."""
        return int(self.tokenizer.partition(":")[2]) if self.tokenizer.startswith("trained:") else None

    @property
    def extensions(self) -> frozenset[str]:
        return frozenset(self.ext) if self.ext is not None else DEFAULT_EXTENSIONS

    def to_json(self) -> dict[str, Any]:
        """The manifest's "settings" object (JSON values only, so it compares equal to one read back)."""
        value = {
            "source": self.source,
            "text_field": self.text_field,
            "val_fraction": self.val_fraction,
            "shard_tokens": self.shard_tokens,
            "seed": self.seed,
            "tokenizer": self.tokenizer,
            "decontaminate": sorted(self.decontaminate),
            "ext": sorted(self.ext) if self.ext is not None else None,
            "dedup": dataclasses.asdict(self.dedup),
            "clean": {"mode": self.clean_mode, **dataclasses.asdict(self.clean)} if self.clean_mode != "none" else None,
            "quality": dataclasses.asdict(self.quality) if self.quality.flag is not None else None,
            "corpus": dict(zip(("files", "bytes", "sha256"), self.corpus, strict=True)) if self.corpus else None,
            "tokenizer_sha256": self.tokenizer_sha256,
        }
        return json.loads(json.dumps(value))

    def matches(self, saved: Any) -> bool:
        """Whether a folder's saved settings are these; a key it lacks matches only its default."""
        if not isinstance(saved, dict):
            return False
        return saved == self._expected(saved)

    def _expected(self, saved: dict[str, Any]) -> dict[str, Any]:
        """These settings as a folder holding `saved` would have recorded them (a later key at its default
        stays out of an older folder's)."""
        mine = self.to_json()
        if _same_place(saved.get("source"), self.source):  # the same folder, however the path was written
            mine["source"] = saved["source"]
        defaults = PrepareSettings(**{f: getattr(self, f) for f in _LEGACY_FIELDS}).to_json()
        return {
            k: v
            for k, v in mine.items()
            if k in saved or (k not in LATER_KEYS and k not in UNRECORDED) or (k in LATER_KEYS and v != defaults[k])
        }

    def difference(self, saved: dict[str, Any]) -> str:
        """The first setting that differs from `saved`, as 'FLAG was OLD, now NEW'."""
        expected = self._expected(saved)
        for key, flag in SETTING_FLAGS.items():
            if key == "corpus" and key in expected and saved.get(key) != expected[key]:
                return f"SOURCE changed: {_files_said(saved.get(key))} then, {_files_said(expected[key])} now"
            if key == "quality" and _only_state_differs(saved.get(key), expected.get(key)):
                q = self.quality
                what = "--quality REF's files" if q.reference is not None else f"--quality-labels {q.labels}"
                return f"{what} changed since, so the classifier would learn from other documents"
            if key in expected and saved.get(key) != expected[key]:
                return _changed(flag, saved.get(key), expected[key])
        return f"settings with keys this version does not write ({', '.join(sorted(set(saved) - set(expected)))})"


def _only_state_differs(old: Any, new: Any) -> bool:
    """Whether two saved quality settings differ in the digest of REF or the labels file alone."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return False
    return {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)} == {"state"}


def tokenizer_digest(tokenizer: str) -> str | None:
    """The sha256 of a --tokenizer file; None for 'gpt2', a trained one, or a file not there (refused later)."""
    path = Path(tokenizer)
    if tokenizer == "gpt2" or tokenizer.startswith("trained:") or not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


_LEGACY_FIELDS = ("source", "text_field", "val_fraction", "shard_tokens", "seed", "tokenizer", "decontaminate")


def _changed(flag: str, old: Any, new: Any, shown: int = 3) -> str:
    """'FLAG was OLD, now NEW' on one line: for settings saved as objects, each value that differs (the first
    `shown`), e.g. "--dedup mode was 'near', now 'exact'"."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return f"{flag} was {_said(old)}, now {_said(new)}"
    changes = [f"{key} was {_said(a)}, now {_said(b)}" for key, a, b in _leaves(old, new) if a != b]
    more = f"; and {len(changes) - shown} more" if len(changes) > shown else ""
    return f"{flag} " + "; ".join(changes[:shown]) + more


def _leaves(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of each value in two objects, nested ones key by key."""
    out = []
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _leaves(a, b, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", a, b))
    return out


def _said(value: Any) -> str:
    """A saved setting as read on a line: an object by its mode (or its values set), a list comma-separated, None
    (a setting left at its default: no cleaning, no classifier, the default file types)."""
    if isinstance(value, dict):
        if "mode" in value:
            return repr(value["mode"])
        return ", ".join(f"{k}={_said(v)}" for k, v in value.items() if v is not None) or "the default"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "none"
    return "the default" if value is None else repr(value)


def _files_said(corpus: dict[str, Any] | None) -> str:
    if not isinstance(corpus, dict):
        return "a corpus not listed"
    digest = str(corpus.get("sha256"))[:12]
    return f"{corpus.get('files', 0):,} files of {corpus.get('bytes', 0):,} bytes (digest {digest})"


def _check_names(source: str, tokenizer: str, decontaminate: Sequence[str]) -> None:
    """One line for an empty name, which would otherwise read the current folder or a file named ''."""
    for flag, value in (
        ("SOURCE", source),
        ("--tokenizer", tokenizer),
        *(("--decontaminate", d) for d in decontaminate),
    ):
        if not str(value).strip():
            raise GptforgeError(f"{flag} {value!r}: empty (expected a name)")
    if source.startswith("hf:") and not source[3:].partition(":")[0].strip():
        raise GptforgeError(f"SOURCE {source!r}: names no dataset (expected hf:NAME[:CONFIG])")


def _same_place(saved: Any, source: str) -> bool:
    """Whether a saved SOURCE names the same local path as `source` ('c1', 'c1/', './c1' and its absolute path)."""
    named = (s for s in (saved, source) if isinstance(s, str))
    if any(s == "stdlib" or s.startswith("hf:") for s in named) or not isinstance(saved, str):
        return saved == source
    return os.path.abspath(saved) == os.path.abspath(source)


def _check_numbers(val_fraction: float, shard_tokens: int) -> None:
    if shard_tokens <= 0:
        raise GptforgeError(f"--shard-tokens must be positive, got {shard_tokens}")
    if not 0 <= val_fraction < 1:
        raise GptforgeError(f"--val-fraction must be in [0, 1), got {val_fraction}")


def check_dedup(settings: DedupSettings) -> DedupSettings:
    """The --dedup settings, or one line naming the flag whose value cannot work."""
    if settings.mode not in DEDUP_MODES:
        raise GptforgeError(f"--dedup {settings.mode!r}: expected one of {', '.join(DEDUP_MODES)}")
    if not 0 < settings.threshold <= 1:
        raise GptforgeError(f"--dedup-threshold must be in (0, 1], got {settings.threshold}")
    for flag, value, most in (
        ("--dedup-shingle", settings.shingle, MAX_SHINGLE),
        ("--dedup-hashes", settings.hashes, MAX_HASHES),
    ):
        if not 1 <= value <= most:
            raise GptforgeError(f"{flag} must be in [1, {most}], got {value}")
    if settings.bands < 1 or settings.hashes % settings.bands:
        raise GptforgeError(
            f"--dedup-bands {settings.bands}: expected a positive divisor of --dedup-hashes {settings.hashes}"
        )
    if settings.mode != "near":  # ignored, they would still count as other settings when the folder is reused
        default = DedupSettings(mode=settings.mode)
        for name in ("threshold", "shingle", "hashes", "bands"):
            if getattr(settings, name) != getattr(default, name):
                raise GptforgeError(
                    f"--dedup-{name} {getattr(settings, name)}: tunes near de-duplication, which --dedup "
                    f"{settings.mode} does not run; pass --dedup near"
                )
    return settings


def _check_clean_set(mode: str, items: Sequence[str]) -> None:
    """One line for a --clean-set item that changes filters the --clean mode does not run (it would be ignored)."""
    for item in items:
        key, _, value = (part.strip() for part in item.partition("="))
        names = [n.strip() for n in value.split(",") if n.strip()] if key == "skip" else [key]
        other = next((n.partition(".")[0] for n in names if n.partition(".")[0] != mode), None)
        if other is not None:
            raise GptforgeError(
                f"--clean-set {item}: changes {other} filters, which --clean {mode} does not run; pass --clean {other}"
            )
