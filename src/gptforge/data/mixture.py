"""Weighted mixtures of prepared data folders: `data.mix` parsed and checked, and `MixtureLoader` serving them.

The training stream is one sequence of windows whatever the batch size or world size: window n comes from the
source whose next window is due first (source i's k-th window is due by window k / w_i; earliest deadline first
among the sources still under their share). After every window each source has served n·w_i windows rounded down
or up, so any stretch of L windows (a global batch, an optimizer step, an hour of training) holds L·w_i of each
source to within less than two windows, less than one with two sources. Each source serves its windows in its own
seeded epoch order, exactly as `TokenLoader` would alone, and counts its epochs separately; a global batch takes the
next B*world windows of the stream and rank r gets the r-th block of B, as `TokenLoader` does.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptforge.data.fim import FIM
from gptforge.data.loader import TokenLoader, check_seq_len
from gptforge.data.shards import read_manifest
from gptforge.errors import GptforgeError
from gptforge.tokens.tokenizer import Tokenizer, load_tokenizer, same_tokenizer

# A weight is a plain decimal of at most 24 characters with an exponent of at most two digits: exact as a Fraction,
# and bounded, as `1e1000000000` (a billion-digit integer to build) or `1e-4400` (a share whose text passes Python's
# 4,300-digit limit when the loader's state is saved) would not be.
WEIGHT = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,2})?")
WEIGHT_CHARS = 24


@dataclass(frozen=True)
class Source:
    """One folder of a mixture."""

    name: str
    """The folder's name: the suffix of its metrics (`loss/NAME`, `epoch/NAME`)."""
    path: str
    weight: str
    """The weight as written in `data.mix`."""
    share: Fraction
    """The weight over the sum of the weights: this source's exact share of the training windows."""


def parse_mix(items: list[str]) -> list[Source]:
    """`data.mix`'s FOLDER=WEIGHT entries as sources (weights positive, each folder and name once); no file is read."""
    entries = []
    for item in items:
        path, eq, weight = (part.strip() for part in item.rpartition("="))
        if not eq or not path:
            raise GptforgeError(f"data.mix: {item!r} (expected FOLDER=WEIGHT, e.g. data/code=0.7)")
        value = Fraction(weight) if len(weight) <= WEIGHT_CHARS and WEIGHT.fullmatch(weight) else Fraction(0)
        if value <= 0:
            raise GptforgeError(
                f"data.mix: {item!r} has weight {weight!r} (expected a positive number written as a decimal such as "
                f"0.7, 3 or 2.5e-3: at most {WEIGHT_CHARS} characters, an exponent of at most two digits)"
            )
        entries.append((Path(os.path.abspath(path)).name, path, weight, value))
    for i, (name, path, _, _) in enumerate(entries):
        for other_name, other, _, _ in entries[:i]:
            if Path(path).resolve() == Path(other).resolve():
                raise GptforgeError(f"data.mix: {other} and {path} are the same folder; list it once")
            if name == other_name:
                raise GptforgeError(
                    f"data.mix: {other} and {path} are both named {name!r} (each folder's metrics are named after "
                    "it); rename or link one"
                )
    total = sum(e[3] for e in entries)
    return [Source(name, path, weight, value / total) for name, path, weight, value in entries]


def open_mix(sources: list[Source]) -> tuple[Tokenizer, list[dict[str, Any]]]:
    """The tokenizer every folder was prepared with, and their manifests; a missing, unprepared or differently
    tokenized folder is refused in one line naming it."""
    manifests, tokenizers = [], []
    for source in sources:
        try:
            manifest = read_manifest(source.path)
        except GptforgeError as e:
            raise GptforgeError(f"data.mix: {e}") from None
        tokenizers.append(load_tokenizer(manifest["tokenizer"]["name"], source.path))
        manifests.append(manifest)
        first, this = _tokenizer_text(manifests[0], tokenizers[0]), _tokenizer_text(manifest, tokenizers[-1])
        if first != this or not same_tokenizer(tokenizers[0], tokenizers[-1]):
            raise GptforgeError(
                f"data.mix: {source.path} was prepared with tokenizer {this}, {sources[0].path} with "
                f"{'another ' if first == this else ''}{first}; every folder of a mix needs the same tokenizer: "
                f"prepare {source.path}'s corpus again with --tokenizer {tokenizers[0].path or tokenizers[0].name}"
            )
    return tokenizers[0], manifests


def _tokenizer_text(manifest: dict[str, Any], tokenizer: Tokenizer) -> str:
    tok = manifest["tokenizer"]
    return f"{tokenizer.name} ({tok['vocab_size']:,} tokens, eot {tok.get('eot')})"


class Schedule:
    """Which source each window of the stream comes from: earliest deadline first, in integers, so that every
    rank and machine computes the same stream."""

    def __init__(self, shares: list[Fraction]) -> None:
        self.q = math.lcm(*(s.denominator for s in shares))
        self.p = [int(s * self.q) for s in shares]  # share i = p[i] / q exactly
        self.counts = [0] * len(shares)
        """Windows scheduled from each source since these shares applied."""

    def next(self) -> int:
        n, q = sum(self.counts), self.q
        # Source i may take window n while it is under its share after it (c_i < (n+1)·w_i); its next window is
        # due by window ceil((c_i+1) / w_i). Shares summing to 1, some source is always under its share.
        due = [
            (-(-(c + 1) * q // p), i)
            for i, (c, p) in enumerate(zip(self.counts, self.p, strict=True))
            if c * q < (n + 1) * p
        ]
        source = min(due)[1]  # the earliest deadline; the first source of the mix on a tie
        self.counts[source] += 1
        return source


class MixtureLoader:
    """Batches of (x, y) windows drawn from several folders by weight; disjoint across ranks, resumable."""

    def __init__(
        self,
        sources: list[Source],
        split: str,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        fim: FIM | None = None,
        step_windows: int = 0,
    ) -> None:
        self.sources = sources
        # Source i's epochs are shuffled with seed + i: a one-source mix is the TokenLoader of its folder.
        self.loaders = [
            TokenLoader(s.path, split, batch_size, seq_len, rank, world_size, seed + i, shuffle, fim, step_windows)
            for i, s in enumerate(sources)
        ]
        self.B, self.T, self.rank, self.world = batch_size, seq_len, rank, world_size
        self.schedule = Schedule([s.share for s in sources])
        self.taken = [0] * len(sources)
        """Windows served from each source since the run began: its epoch and the position in it."""
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    def _next_window(self, i: int) -> tuple[int, int]:
        """Source i's next window and the epoch it belongs to."""
        epoch, k = divmod(self.taken[i], self.loaders[i].epoch_windows)
        if self._orders.get(i, (None,))[0] != epoch:
            self._orders[i] = (epoch, self.loaders[i].order(epoch))
        self.taken[i] += 1
        return int(self._orders[i][1][k]), epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (x, y), both (B, T) int64: its block of the stream's next B*world windows; a chat
        folder's targets are -1 outside the replies, as its `TokenLoader` serves them."""
        picks = [self.schedule.next() for _ in range(self.B * self.world)]
        windows = [(i, self._next_window(i)) for i in picks]  # every rank advances every source alike
        for loader in self.loaders:
            loader.verifier.check()
        mine = windows[self.rank * self.B : (self.rank + 1) * self.B]
        rows = [self.loaders[i].served(*w).astype(np.int64) for i, w in mine]
        targets = [
            row[1:] if self.loaders[i].masks is None else self.loaders[i].chat_targets(w[0], row)
            for (i, w), row in zip(mine, rows, strict=True)
        ]
        return torch.from_numpy(np.stack(rows)[:, :-1]), torch.from_numpy(np.stack(targets))

    def verify(self) -> None:
        """Wait until every shard of every source is checked; raise on a mismatch."""
        for loader in self.loaders:
            loader.verify()

    def state_dict(self) -> dict[str, Any]:
        sources = {
            s.name: {"seed": ld.seed, "windows": taken, "share": str(s.share), "scheduled": scheduled}
            for s, ld, taken, scheduled in zip(
                self.sources, self.loaders, self.taken, self.schedule.counts, strict=True
            )
        }
        return {"batch_size": self.B, "seq_len": self.T, "world_size": self.world, "sources": sources}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`. Each source named in it goes on from its position; with the same shares the
        schedule goes on too (the stream is the uninterrupted one), with new ones it starts afresh from here."""
        check_seq_len(state, self.T)
        saved = state.get("sources")
        if not isinstance(saved, dict):
            raise GptforgeError("cannot resume the data position: it was saved by a single-folder run (data.path)")
        for i, source in enumerate(self.sources):
            if source.name in saved:
                self.loaders[i].seed, self.taken[i] = saved[source.name]["seed"], saved[source.name]["windows"]
        same_shares = {name: s["share"] for name, s in saved.items()} == {s.name: str(s.share) for s in self.sources}
        self.schedule.counts = [saved[s.name]["scheduled"] if same_shares else 0 for s in self.sources]
        self._orders.clear()

    def progress(self, state: dict[str, Any]) -> dict[str, float]:
        """Each source's epochs served by the position `state` (a `state_dict()`), for the train records."""
        return {
            f"epoch/{s.name}": state["sources"][s.name]["windows"] / ld.epoch_windows
            for s, ld in zip(self.sources, self.loaders, strict=True)
        }

    def describe(self, tokens: int) -> str:
        """Each source's share, tokens and epochs over `tokens` training tokens: the plan printed at the start."""
        width = max(len(s.name) for s in self.sources)
        n = len(self.sources)
        lines = [f"data: a mix of {n} folder{'s' if n > 1 else ''} over the planned {tokens:,} tokens"]
        for s, ld in zip(self.sources, self.loaders, strict=True):
            mine, epoch = float(s.share) * tokens, ld.epoch_windows * self.T
            lines.append(
                f"  {s.name:<{width}} {float(s.share):6.1%} | {mine:>14,.0f} tokens | "
                f"{mine / epoch:7.2f} epochs of {epoch:,} tokens | {s.path}"
            )
        return "\n".join(lines)
