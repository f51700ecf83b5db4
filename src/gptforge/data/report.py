"""What `prepare` removed and kept, stage by stage: counted while documents are decided, saved in the manifest
("report"), as a report.md a person reads, and as removed.jsonl: a row for every removed document."""

from __future__ import annotations

import json
import re
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptforge.errors import one_line

SAMPLES = 10  # removed pairs and filtered documents shown in report.md
SIDES = ("kept", "removed")
TENTHS = 10  # the quality scores' histogram bins, each [i/10, (i+1)/10)
QUALITY_SAMPLES = 3  # documents kept and removed by the quality classifier shown per tenth of the scores, each
REMOVED_FILE = "removed.jsonl"
STAGES = (
    "read",
    "binary skipped",
    "undecodable skipped",
    "empty skipped",
    "filtered",
    "quality",
    "exact duplicates",
    "near duplicates",
    "decontaminated",
    "kept",
)


@dataclass
class Report:
    """Documents and bytes per stage and per language, the first removed documents as samples, and a removed.jsonl
    row for each removed one (encoded: a row costs its bytes, not a dict's)."""

    docs: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    filters: dict[str, list[int]] = field(default_factory=dict)  # filter name -> [docs, bytes]
    languages: dict[str, list[int]] = field(default_factory=dict)  # language -> [read, kept]
    pairs: list[dict[str, Any]] = field(default_factory=list)
    filtered: list[dict[str, str]] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    scores: array = field(default_factory=lambda: array("d"))  # the quality classifier's, in document order
    # per tenth of the score range, the first documents kept and removed in it (what a threshold there would cut)
    scored_samples: list[dict[str, list[dict[str, Any]]]] = field(
        default_factory=lambda: [{side: [] for side in SIDES} for _ in range(TENTHS)]
    )

    def count(self, stage: str, n_bytes: int) -> None:
        self.docs[stage] += 1
        self.bytes[stage] += n_bytes

    def read(self, language: str | None, n_bytes: int) -> None:
        self.count("read", n_bytes)
        self.languages.setdefault(language or "unknown", [0, 0])[0] += 1

    def kept(self, language: str | None, n_bytes: int) -> None:
        self.count("kept", n_bytes)
        self.languages[language or "unknown"][1] += 1

    def skipped(self, name: str, why: str, n_bytes: int) -> None:
        self.count(f"{why} skipped", n_bytes)
        self.removed.append(removal(name, f"{why} skipped", bytes=n_bytes))

    def decontaminated(self, name: str, n_bytes: int) -> None:
        self.count("decontaminated", n_bytes)
        self.removed.append(removal(name, "decontaminated", bytes=n_bytes))

    def filter_removed(self, name: str, rule: str, reason: str, n_bytes: int) -> None:
        self.count("filtered", n_bytes)
        self.removed.append(removal(name, "filtered", bytes=n_bytes, filter=rule, reason=reason))
        counts = self.filters.setdefault(rule, [0, 0])
        counts[0], counts[1] = counts[0] + 1, counts[1] + n_bytes
        if len(self.filtered) < SAMPLES:
            self.filtered.append({"removed": name, "filter": rule, "reason": reason})

    def duplicate(self, kind: str, name: str, kept: str, similarity: float, n_bytes: int) -> None:
        self.count(f"{kind} duplicates", n_bytes)
        self.removed.append(removal(name, f"{kind} duplicates", bytes=n_bytes, kept=kept, jaccard=round(similarity, 4)))
        if len(self.pairs) < SAMPLES:
            self.pairs.append({"removed": name, "kept": kept, "kind": kind, "similarity": round(similarity, 3)})

    def scored(self, name: str, score: float, kept: bool, n_bytes: int) -> None:
        """A document the quality classifier scored; a removed one is counted and traced with its score."""
        self.scores.append(score)
        if not kept:
            self.count("quality", n_bytes)
            self.removed.append(removal(name, "quality", bytes=n_bytes, score=round(score, 4)))
        shown = self.scored_samples[int(_tenths(score))]["kept" if kept else "removed"]
        if len(shown) < QUALITY_SAMPLES:
            shown.append({"document": name, "score": round(score, 4)})

    def quality(self) -> dict[str, Any] | None:
        """The scores' summary (count, mean, deciles, a histogram by tenths) and, per tenth, the first documents
        kept and removed; None when no classifier ran."""
        if not self.scores:
            return None
        scores = np.frombuffer(self.scores, dtype=np.float64)
        return {
            "count": len(scores),
            "mean": round(float(scores.mean()), 4),
            "deciles": [round(float(q), 4) for q in np.quantile(scores, np.linspace(0, 1, 11))],
            "histogram": np.bincount(_tenths(scores), minlength=TENTHS).tolist(),
            "samples": self.scored_samples,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "stages": {s: {"docs": self.docs[s], "bytes": self.bytes[s]} for s in STAGES},
            "filters": {k: {"docs": d, "bytes": b} for k, (d, b) in self.filters.items()},
            "languages": {k: {"read": r, "kept": k_} for k, (r, k_) in sorted(self.languages.items())},
            "duplicate_pairs": self.pairs,
            "filtered_samples": self.filtered,
            "removed_rows": len(self.removed),
            **({"quality": self.quality()} if self.scores else {}),
        }


def removal(document: str, stage: str, **details: Any) -> bytes:
    """One removed.jsonl row: the document (file path, or file:line), the stage that removed it, and why."""
    return json.dumps({"document": document, "stage": stage, **details}, ensure_ascii=False).encode() + b"\n"


def render(report: dict[str, Any], settings: dict[str, Any]) -> str:
    """report.md from the manifest's "report" object and settings."""
    # Skipped files never become documents read: the shares are of every byte met, so they add up to 100%.
    total = sum(c["bytes"] for stage, c in report["stages"].items() if stage == "read" or "skipped" in stage) or 1
    lines = ["# What prepare removed", "", f"Source: `{settings['source']}`; dedup: `{settings.get('dedup')}`;"]
    lines += [f"clean: `{(settings.get('clean') or {}).get('mode', 'none')}`.", ""]
    lines += ["| stage | documents | bytes | share of all bytes |", "| --- | ---: | ---: | ---: |"]
    for stage, c in report["stages"].items():
        lines.append(f"| {stage} | {c['docs']:,} | {c['bytes']:,} | {100 * c['bytes'] / total:.2f}% |")
    for name, c in sorted(report["filters"].items()):
        lines.append(f"| filter `{name}` | {c['docs']:,} | {c['bytes']:,} | {100 * c['bytes'] / total:.2f}% |")
    lines += ["", "## Languages", "", "| language | read | kept |", "| --- | ---: | ---: |"]
    lines += [f"| {lang} | {c['read']:,} | {c['kept']:,} |" for lang, c in report["languages"].items()]
    lines += [
        "",
        f"Every removed document is a row of `{REMOVED_FILE}` ({report['removed_rows']:,} rows): its stage, and for a "
        "copy the document kept and the exact Jaccard similarity of their shingles.",
    ]
    if report["duplicate_pairs"]:
        lines += ["", "## Removed duplicates (first ones; the earliest document of a cluster is kept)", ""]
        lines += ["| removed | kept | kind | Jaccard similarity |", "| --- | --- | --- | ---: |"]
        lines += [
            f"| {_code(p['removed'])} | {_code(p['kept'])} | {p['kind']} | {p['similarity']:.3f} |"
            for p in report["duplicate_pairs"]
        ]
    if report["filtered_samples"]:
        lines += ["", "## Filtered documents (first ones)", "", "| removed | filter | reason |", "| --- | --- | --- |"]
        rows = report["filtered_samples"]
        lines += [f"| {_code(f['removed'])} | `{f['filter']}` | {_cell(f['reason'])} |" for f in rows]
    if report.get("quality"):
        lines += _quality_lines(report["quality"], settings.get("quality") or {})
    return "\n".join(lines) + "\n"


def _quality_lines(quality: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """report.md's section on the quality classifier: how scores spread, and documents on each side."""
    threshold = settings.get("threshold")
    rule = f"kept when the score is at least {threshold}" if threshold is not None else "GPT-3's Pareto rule"
    source = (
        f"Reference: `{settings['reference']}`" if settings.get("reference") else f"Labels: `{settings.get('labels')}`"
    )
    lines = ["", "## Quality scores", "", f"{source}; {rule}; "]
    lines[-1] += f"{quality['count']:,} documents scored, mean {quality['mean']:.3f}."
    lines += ["", "| score | documents | first kept (score) | first removed (score) |", "| --- | ---: | --- | --- |"]
    for i, (n, shown) in enumerate(zip(quality["histogram"], quality["samples"], strict=True)):
        kept, removed = (", ".join(f"{_code(d['document'])} ({d['score']:.3f})" for d in shown[s]) for s in SIDES)
        lines.append(f"| {i / 10:.1f}-{(i + 1) / 10:.1f} | {n:,} | {kept} | {removed} |")
    return lines


def _tenths(scores: float | np.ndarray) -> np.ndarray:
    """The tenth of [0, 1] each score falls in (a score of exactly 1 in the last)."""
    return np.minimum((np.asarray(scores) * TENTHS).astype(int), TENTHS - 1)


def _code(name: str) -> str:
    """A document's name as a table cell's code span: a `|` escaped, a newline or tab shown as its escape, and a
    fence longer than any run of backticks in the name (each would otherwise split the row or end the span)."""
    shown = _cell(name)
    fence = "`" * (max(map(len, re.findall("`+", shown)), default=0) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


def _cell(text: str) -> str:
    """`text` kept to one table cell: a `|` escaped, a newline or tab shown as its escape (a filter's reason quotes
    the document's own text)."""
    return one_line(text).replace("|", "\\|")


FEW_KEPT = 0.1  # a classifier keeping less than this share of what it scored is said loudly


def _few_kept_by_quality(report: dict[str, Any], stages: dict[str, Any]) -> list[str]:
    """A warning when the quality classifier kept almost nothing, with the thresholds its score deciles give."""
    scored = report.get("quality", {}).get("count", 0)
    kept = scored - stages["quality"]["docs"]
    if not scored or kept >= FEW_KEPT * scored:
        return []
    deciles = report["quality"]["deciles"]
    return [
        f"warning: the quality classifier kept {kept:,} of the {scored:,} documents it scored ({kept / scored:.1%}): "
        f"--quality-threshold {deciles[5]:.3f} would keep about half of them, {deciles[1]:.3f} about 90% "
        "(the scores' deciles; report.md shows each tenth's documents)"
    ]


def summarize(manifest: dict[str, Any], out_dir: str | Path) -> str:
    """What `gptforge prepare` wrote, a line per split, and what each stage removed (a folder from before the report
    has no such line)."""
    lines = [
        f"{split}: {s['docs']:,} documents, {s['tokens']:,} tokens, {s['bytes'] / 1e6:.1f} MB"
        for split, s in manifest["splits"].items()
    ]
    held_out = manifest.get("settings", {}).get("val_fraction", 0) > 0
    if held_out and not manifest["splits"].get("val", {}).get("docs"):  # the filters or the classifier took them
        lines.append("val: none kept, the stages removed every held-out document: train will run without validation")
    if "report" in manifest:
        stages = manifest["report"]["stages"]
        removed = [
            f"{stage} {c['docs']:,} ({c['bytes'] / 1e6:.2f} MB)"
            for stage, c in stages.items()
            if stage not in ("read", "kept") and c["docs"]
        ]
        # Skipped files never become documents read: "met" counts them too, so kept + removed = met.
        met = sum(c["docs"] for stage, c in stages.items() if stage == "read" or "skipped" in stage)
        lines.append(f"removed: {', '.join(removed) or 'nothing'} of {met:,} documents met (see report.md)")
        lines += _few_kept_by_quality(manifest["report"], stages)
    # Not "wrote": a folder already prepared was only read.
    return "\n".join([*lines, one_line(f"{out_dir}: {len(manifest['shards'])} shard(s) and manifest.json")])
