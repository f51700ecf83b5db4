"""KV caches for generation: one sequence batch growing a token at a time (KVCache), and rows holding separate
sequences of their own lengths for continuous batching (RowCache; StaticCache, of fixed shapes, for a compiled step)."""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch
import torch.nn.functional as F


class Shape(Protocol):
    """What a cache needs of a model's config (GPTConfig has it)."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int


class KVCache:
    """Keys and values of the positions seen so far, per layer, for incremental decoding."""

    def __init__(self, cfg: Shape, batch: int, device: torch.device) -> None:
        self.shape = (cfg.n_layer, 2, batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        self.device = device
        self.kv: torch.Tensor | None = None  # allocated at the first update, in the dtype autocast produces
        self.pos = 0  # positions filled

    @property
    def length(self) -> int:
        return self.pos

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.pos, self.pos + T, device=device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's (B, nh, T, hs) keys/values; return all keys/values up to them."""
        if self.pos and k.size(2) > 1:
            raise ValueError("a KV cache takes one prompt (from position 0), then one token at a time")
        if self.kv is None:
            self.kv = torch.zeros(self.shape, device=self.device, dtype=k.dtype)
        end = self.pos + k.size(2)
        self.kv[layer, 0, :, :, self.pos : end] = k
        self.kv[layer, 1, :, :, self.pos : end] = v
        return self.kv[layer, 0, :, :, :end], self.kv[layer, 1, :, :, :end]

    def advance(self, T: int) -> None:
        self.pos += T


class RowCache:
    """A KV cache whose rows hold separate sequences, each at its own length, for continuous batching: a row is
    filled from a one-sequence KVCache (its prompt), then every row in use (0 .. rows-1) decodes one token a step.
    The rows of one length attend together and to their own positions only, so each row's output is what it would
    be alone (a mask over padded keys rounds differently: a bf16 greedy token could change with the batch)."""

    def __init__(self, cfg: Shape, capacity: int, device: torch.device) -> None:
        self.shape = (cfg.n_layer, 2, capacity, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        self.device = device
        self.kv: torch.Tensor | None = None  # in the prompt's dtype; grows (doubling) to the rows in use
        self.lengths: list[int] = []  # positions filled, per row in use
        self._lengths: torch.Tensor | None = None  # this step's, as a tensor
        self._groups: list[tuple[int, torch.Tensor | slice]] = []  # this step's (keys, rows) of each length

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        return max(self.lengths, default=0)

    def add(self, prompt: KVCache) -> int:
        """Copy a one-sequence cache into the next free row; returns the row."""
        if self.rows == self.shape[2]:
            raise ValueError(f"every one of the {self.shape[2]} rows is in use")
        if self.kv is None or self.kv.size(2) == self.rows:
            grown = torch.zeros(
                (*self.shape[:2], min(2 * self.rows or 1, self.shape[2]), *self.shape[3:]),
                device=self.device,
                dtype=prompt.kv.dtype,
            )
            if self.kv is not None:
                grown[:, :, : self.rows] = self.kv
            self.kv = grown
        row, n = self.rows, prompt.pos
        self.kv[:, :, row, :, :n] = prompt.kv[:, :, 0, :, :n]
        self.lengths.append(n)
        return row

    def remove(self, row: int) -> None:
        """Free `row`: the last row in use moves into it (so the rows in use stay 0 .. rows-1)."""
        last = self.rows - 1
        if row != last:
            n = self.lengths[last]
            self.kv[:, :, row, :, :n] = self.kv[:, :, last, :, :n]
            self.lengths[row] = n
        self.lengths.pop()

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        """(rows, 1): each row's next position; also groups this step's rows by length."""
        if T != 1:
            raise ValueError("a row cache decodes one token per row; fill each row's prompt with a KVCache")
        by_length: dict[int, list[int]] = {}
        for row, n in enumerate(self.lengths):
            by_length.setdefault(n, []).append(row)
        self._groups = [
            (
                n + 1,
                slice(rows[0], rows[-1] + 1)
                if rows[-1] - rows[0] == len(rows) - 1
                else torch.tensor(rows, device=device),
            )
            for n, rows in by_length.items()
        ]
        self._lengths = torch.tensor(self.lengths, device=device)
        return self._lengths[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store each row's new key/value at its own position; return every row's keys/values (to the longest)."""
        rows, end = torch.arange(self.rows, device=k.device), self.length + 1
        self.kv[layer, 0][rows, :, self._lengths] = k[:, :, 0]
        self.kv[layer, 1][rows, :, self._lengths] = v[:, :, 0]
        return self.kv[layer, 0, : self.rows, :, :end], self.kv[layer, 1, : self.rows, :, :end]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of each row's new query to its own positions: one call per length, with no padding."""
        if len(self._groups) == 1:
            return F.scaled_dot_product_attention(q, k, v)
        y = torch.empty_like(q)
        for n, rows in self._groups:
            y[rows] = F.scaled_dot_product_attention(q[rows], k[rows, :, :n], v[rows, :, :n])
        return y

    def advance(self, T: int) -> None:
        self.lengths = [n + T for n in self.lengths]
        self._lengths = None


class StaticCache:
    """Rows of separate sequences in tensors of fixed shape, for a decode step compiled once per batch size: each
    row writes its key and value at its own position and attends to the positions up to it through a mask. The
    first `batch` rows decode (the rows in use, padded to a size compiled for); `length` is 0, as the engine keeps
    every row inside the context (a number that changed every step would recompile the step). Each layer's keys
    and values are tensors of their own: a compiled step writes into those in place, where a write into a view of
    one tensor for all layers made it copy the whole cache every token (3.7x the step's time on the demo model)."""

    length = 0

    def __init__(self, cfg: Shape, capacity: int, device: torch.device) -> None:
        self.shape = (cfg.n_layer, 2, capacity, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        self.device, self.block = device, cfg.block_size
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, in the prompt's dtype, at the first row
        self.filled = torch.zeros(capacity, dtype=torch.long, device=device)  # positions filled, per row
        self.rows = 0  # rows in use: 0 .. rows-1
        self.batch = 1

    def add(self, prompt: KVCache) -> int:
        """Copy a one-sequence cache into the next free row; returns the row."""
        if self.rows == self.shape[2]:
            raise ValueError(f"every one of the {self.shape[2]} rows is in use")
        if not self.kv:
            zeros = functools.partial(torch.zeros, self.shape[2:], device=self.device, dtype=prompt.kv.dtype)
            self.kv = [(zeros(), zeros()) for _ in range(self.shape[0])]
        row, n = self.rows, prompt.pos
        for layer, (k, v) in enumerate(self.kv):
            k[row, :, :n] = prompt.kv[layer, 0, 0, :, :n]
            v[row, :, :n] = prompt.kv[layer, 1, 0, :, :n]
        self.filled[row] = n
        self.rows += 1
        return row

    def remove(self, row: int) -> None:
        """Free `row`: the last row in use moves into it."""
        last = self.rows - 1
        if row != last:
            for k, v in self.kv:
                k[row], v[row] = k[last], v[last]
            self.filled[row] = self.filled[last]
        self.rows -= 1

    def decode(self, batch: int) -> None:
        """The next step decodes the first `batch` rows; those past the rows in use pad, writing at position 0."""
        self.batch = batch
        if batch > self.rows:  # an empty fill took 20 us, a tenth of the demo model's compiled step
            self.filled[self.rows : batch] = 0

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        if T != 1:
            raise ValueError("a static cache decodes one token per row; fill each row's prompt with a KVCache")
        return self.filled[: self.batch, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, at = torch.arange(self.batch, device=k.device), self.filled[: self.batch]
        keys, values = self.kv[layer]
        keys[rows, :, at] = k[:, :, 0]
        values[rows, :, at] = v[:, :, 0]
        return keys[: self.batch], values[: self.batch]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), masked) v written out: compiled, it fuses into the step (SDPA's call for one
        query cost 15% of the demo model's compiled step on CPU)."""
        seen = torch.arange(self.block, device=q.device) <= self.filled[: self.batch, None]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        att = att.masked_fill(~seen[:, None, None, :], float("-inf"))
        return torch.softmax(att.float(), dim=-1).to(v.dtype) @ v

    def advance(self, T: int) -> None:
        self.filled[: self.batch] += T
