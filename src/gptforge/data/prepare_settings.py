"""What a `prepare` run was asked to do: one frozen value, saved as the manifest's "settings" object.

A folder is "already prepared" when its saved settings equal these. Keys added after a folder was written
(dedup, clean, ext) are absent from its settings: absence matches the default, so old folders keep working.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from gptforge.data.dedup import DedupSettings
from gptforge.data.filters import CleanSettings
from gptforge.data.languages import DEFAULT_EXTENSIONS

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
}
LATER_KEYS = ("ext", "dedup", "clean")  # absent from folders prepared before they existed


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
        defaults = PrepareSettings(**{f: getattr(self, f) for f in _LEGACY_FIELDS}).to_json()
        return {k: v for k, v in mine.items() if k in saved or k not in LATER_KEYS or v != defaults[k]}

    def difference(self, saved: dict[str, Any]) -> str:
        """The first setting that differs from `saved`, as 'FLAG was OLD, now NEW'."""
        expected = self._expected(saved)
        for key, flag in SETTING_FLAGS.items():
            if key in expected and saved.get(key) != expected[key]:
                return f"{flag} was {saved.get(key)!r}, now {expected[key]!r}"
        return f"settings were {saved!r}"


_LEGACY_FIELDS = ("source", "text_field", "val_fraction", "shard_tokens", "seed", "tokenizer", "decontaminate")
