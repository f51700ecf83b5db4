"""`TokenLoader`: batches of (x, y) windows from memory-mapped shards, disjoint across ranks, resumable.

A split's shards form one token stream cut into windows of T+1 tokens at stride T (windows cross shard
boundaries). Each epoch serves every window once in a seeded order; a global batch takes B*world windows and
rank r gets the r-th block of B. An epoch holds whole optimizer steps (`step_windows`, the same for any number of
processes), so a run resumes on another number of processes or micro-batch size from the same global window; the
windows left over at an epoch's end are skipped.
Shards with a recorded sha256 are checked on a background thread: batches flow meanwhile, and a mismatch
stops the next batch.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptforge.data.fim import FIM
from gptforge.data.shards import read_manifest, read_mask, read_shard, verify_shard
from gptforge.errors import GptforgeError


class ShardVerifier(threading.Thread):
    """Checks shards against their recorded sha256 off the training path: hashing 100M tokens takes ~0.2 s."""

    def __init__(self, shards: list[tuple[Path, str]]) -> None:
        super().__init__(name="gptforge-verify", daemon=True)
        self.shards, self.error = shards, None
        self.start()

    def run(self) -> None:
        try:
            for path, sha256 in self.shards:
                verify_shard(path, sha256)
        except Exception as e:  # noqa: BLE001 - raised in the loader's thread by check()
            self.error = e

    def check(self, wait: bool = False) -> None:
        """Raise the mismatch found so far; with `wait`, once every shard is checked."""
        if wait:
            self.join()
        if self.error is not None:
            raise self.error


# Said once (by the validation loader) for a folder prepared before de-duplication existed.
UNDEDUPLICATED = (
    "{data_dir}: prepared without de-duplication, so its validation split may hold near-copies of training "
    "documents (prepare it again with --force for the default --dedup near)"
)


class TokenLoader:
    def __init__(
        self,
        data_dir: str | Path,
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
        """`step_windows`: windows an optimizer step takes across all processes (0: one global batch, B x world)."""
        self.fim = fim
        self.manifest = manifest = read_manifest(data_dir)
        if split == "val" and rank == 0 and "dedup" not in manifest.get("settings", {"dedup": None}):
            print(UNDEDUPLICATED.format(data_dir=data_dir), flush=True)
        chat = manifest.get("chat")
        vocab = manifest["tokenizer"]["vocab_size"] + (len(chat["special_tokens"]) if chat else 0)
        self.eot = manifest["tokenizer"].get("eot")
        entries = [s for s in manifest["shards"] if s["split"] == split]
        self.shards = [read_shard(Path(data_dir) / s["file"], vocab) for s in entries]
        # A chat folder's loss masks, one per shard: only the assistant's tokens are learned.
        self.masks = None
        if chat:
            self.masks = [
                read_mask(Path(data_dir) / s["mask"], len(t)) for s, t in zip(entries, self.shards, strict=True)
            ]
        checks = [(s["file"], s["sha256"]) for s in entries if "sha256" in s]
        checks += [(s["mask"], s["mask_sha256"]) for s in entries if chat and "mask_sha256" in s]
        self.verifier = ShardVerifier([(Path(data_dir) / name, sha) for name, sha in checks])
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        self.B, self.T, self.rank, self.world = batch_size, seq_len, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.spans = None if chat is None else pack_conversations(self.shards, self.offsets, self.eot, seq_len + 1)
        if self.masks is not None and self.masks and not _learnable(self.masks, self.spans):
            raise GptforgeError(
                f"{data_dir}: no reply of split {split!r} starts within a window of {seq_len + 1} tokens "
                "(model.block_size): every conversation is cut before its reply; shorten the requests"
            )
        self.n_windows = max(0, (int(self.offsets[-1]) - 1) // seq_len) if self.spans is None else len(self.spans)
        unit = batch_size * world_size
        unit = step_windows if step_windows % unit == 0 and unit <= step_windows <= self.n_windows else unit
        self.batches_per_epoch = self.n_windows // unit * unit // (batch_size * world_size)
        if self.batches_per_epoch == 0:
            more = "prepare it again with a larger --val-fraction" if split == "val" else "add data"
            smaller = "a smaller micro-batch" if batch_size > 1 else "a smaller model.block_size"  # none below 1
            raise GptforgeError(
                f"{data_dir}: split {split!r} has {int(self.offsets[-1]):,} tokens, too few for one batch of "
                f"{batch_size} x {seq_len + 1} tokens x {world_size} rank(s) ({more}, or use {smaller})"
            )
        self.epoch, self.position = 0, 0
        self._order = self.order(0)

    @property
    def epoch_windows(self) -> int:
        """Windows an epoch serves: every window but the tail that cannot fill a global batch."""
        return self.batches_per_epoch * self.B * self.world

    def order(self, epoch: int) -> np.ndarray:
        """The window indices in the order epoch `epoch` serves them."""
        if not self.shuffle:
            return np.arange(self.n_windows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def window(self, w: int, arrays: list[np.ndarray] | None = None) -> np.ndarray:
        """Window `w`'s T+1 tokens (or, given the masks as `arrays`, their mask values). A chat folder's windows
        hold whole conversations, padded with EOT (outside the loss) to T+1."""
        if self.spans is not None:
            start, length = (int(v) for v in self.spans[w])
            piece = self._slice(start, start + length, self.shards if arrays is None else arrays)
            pad = 0 if arrays is not None else self.eot
            return np.concatenate([piece, np.full(self.T + 1 - length, pad, dtype=piece.dtype)])
        return self._slice(w * self.T, w * self.T + self.T + 1, self.shards if arrays is None else arrays)

    def _slice(self, start: int, end: int, arrays: list[np.ndarray]) -> np.ndarray:
        """Tokens `start:end` of the split's stream, across shard boundaries."""
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces = []
        while start < end:
            take = min(end, int(self.offsets[i + 1])) - start
            local = start - int(self.offsets[i])
            pieces.append(arrays[i][local : local + take])
            start += take
            i += 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def chat_targets(self, w: int, tokens: np.ndarray) -> np.ndarray:
        """Window `w`'s targets with -1 where the loss does not count: outside the assistant's replies."""
        return np.where(self.window(w, self.masks)[1:].astype(bool), tokens[1:], -1)

    def served(self, w: int, epoch: int) -> np.ndarray:
        """Window `w` as epoch `epoch` serves it: rearranged for fill-in-the-middle when the loader has `fim`."""
        tokens = self.window(w)
        return tokens if self.fim is None else self.fim.window(tokens.astype(np.int64), (self.seed, epoch, w))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (x, y), both (B, T) int64; advances to a new shuffled epoch when one runs out."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self.order(self.epoch)
        first = self.position * self.B * self.world + self.rank * self.B
        self.position += 1
        return self.batch(self._order[first : first + self.B])

    def batch(self, windows) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for the given window indices; y is x shifted by one token."""
        self.verifier.check()
        buf = torch.from_numpy(np.stack([self.served(int(w), self.epoch) for w in windows]).astype(np.int64))
        if self.masks is None:
            return buf[:, :-1], buf[:, 1:]
        targets = np.stack([self.chat_targets(int(w), row.numpy()) for w, row in zip(windows, buf, strict=True)])
        return buf[:, :-1], torch.from_numpy(targets)

    def verify(self) -> None:
        """Wait until every shard of the split is checked; raise on a mismatch."""
        self.verifier.check(wait=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.B,
            "seq_len": self.T,
            "world_size": self.world,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`, saved with any micro-batch size and number of processes whose global batches
        reach the window it stopped at."""
        if "sources" in state:
            raise GptforgeError("cannot resume the data position: it was saved by a run on a mix (data.mix)")
        check_seq_len(state, self.T)
        served = state["position"] * state["batch_size"] * state["world_size"]  # windows of this epoch
        if served % (self.B * self.world):
            raise GptforgeError(
                f"cannot resume the data position: it stopped {served} windows into an epoch, not a whole number of "
                f"global batches of {self.B} x {self.world} process(es) (resume with train.micro_batch or the "
                f"number of processes it had: {state['batch_size']} x {state['world_size']})"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], served // (self.B * self.world)
        self._order = self.order(self.epoch)

    def progress(self, state: dict[str, Any]) -> dict[str, float]:
        """The epochs served by the position `state` (a `state_dict()`), for the train records."""
        return {"epoch": state["epoch"] + state["position"] / self.batches_per_epoch}

    def describe(self, tokens: int) -> str:
        """What training on `tokens` tokens makes of this split: the run's plan, printed at its start."""
        epoch = self.epoch_windows * self.T
        return f"data: {epoch:,} tokens an epoch; the planned {tokens:,} tokens are {tokens / epoch:.2f} epochs"


def check_seq_len(state: dict[str, Any], seq_len: int) -> None:
    """Refuse a saved data position taken with another window length: its window numbers mean other text."""
    if state["seq_len"] != seq_len:
        raise GptforgeError(
            f"cannot resume the data position: saved with windows of {state['seq_len']} tokens, now {seq_len} "
            "(model.block_size)"
        )


def pack_conversations(shards: list[np.ndarray], offsets: np.ndarray, eot: int, size: int) -> np.ndarray:
    """(start, length) in the stream of each window of whole conversations (each ends with EOT), packed in order
    while they fit `size` tokens; a longer conversation gets a window of its own, cut at `size`."""
    ends = np.concatenate(
        [np.flatnonzero(np.asarray(s) == eot) + int(o) for s, o in zip(shards, offsets, strict=False)]
    )
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    spans, start, fill = [], 0, 0
    for begin, end in zip(starts.tolist(), ends.tolist(), strict=True):
        length = end - begin + 1
        if fill and (fill + length > size or begin != start + fill):
            spans.append((start, fill))
            fill = 0
        if not fill:
            start = begin
        if length >= size:
            spans.append((begin, size))
            continue
        fill += length
    if fill:
        spans.append((start, fill))
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def _learnable(masks: list[np.ndarray], spans: np.ndarray) -> int:
    """Targets the loss counts over every window (a window's first token is never a target)."""
    total = np.concatenate([[0], np.cumsum(np.concatenate([np.asarray(m, dtype=np.int64) for m in masks]))])
    return int((total[spans[:, 0] + spans[:, 1]] - total[spans[:, 0] + 1]).sum())
