"""The one decoding loop under every caller (sample, chat, serve, evaluations): prompts are prefilled once and
shared by the sequences that continue them (n samples), then every sequence in the batch decodes one token a
step, each with its own row of a KV cache, sampling rule, random stream, stop ids and budget. Sequences join
and leave between steps (continuous batching); one that outgrows the context recomputes its last block_size
tokens each step, or ends ("length") when sliding would drop what its prompt must keep."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from gptforge.model.gpt import GPT
from gptforge.model.kv_cache import KVCache, RowCache, StaticCache
from gptforge.model.quantize import WEIGHTS
from gptforge.model.sampling import Sampling, forward_logits, sample_rows
from gptforge.runtime.device import autocast

GREEDY = Sampling(temperature=0.0)
# How the batch decodes: "rows" attends each row to its own positions (no mask, eager); "static" keeps fixed
# shapes (a mask over a static cache, batches padded to a power of two), which "compiled" compiles once per size.
DECODES = ("rows", "static", "compiled")
STOP, LENGTH = "stop", "length"  # why a sequence ended: a stop (an end id, or its watcher's word), or its budget


@dataclass(frozen=True)
class Decoding:
    """How an inference model decodes: its linear weights (one of WEIGHTS) and the engine's step (DECODES)."""

    weights: str = "float"
    step: str = "rows"

    def __post_init__(self) -> None:
        for name, value, allowed in (("weights", self.weights, WEIGHTS), ("decode", self.step, DECODES)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")


FLOAT_ROWS = Decoding()  # the default: float weights, the eager row step


@dataclass(eq=False)
class Sequence:
    """One continuation: its ids (the prompt's, then each token taken), how it picks tokens, when it ends.
    `watch(seq, token, stop)` sees each token (stop: it is an end id) and returns True to end it there (a stop
    string); `ended(seq)` is told once, when it leaves. Sequences with one `prompt_key` share one prefill."""

    ids: list[int]
    max_new_tokens: int
    rule: Sampling = GREEDY
    generator: torch.Generator | None = None
    ends: frozenset[int] = frozenset()
    slides: bool = True  # past the context, recompute the last block_size tokens (else end "length")
    prompt_key: Hashable | None = None
    watch: Callable[[Sequence, int, bool], bool] | None = None
    ended: Callable[[Sequence], None] | None = None
    prompt_tokens: int = field(init=False)
    finish: str | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.ids)

    @property
    def new(self) -> list[int]:
        return self.ids[self.prompt_tokens :]


@dataclass
class _Prefill:
    """A prompt run once for the sequences that share it: its cache (None past the context) and last logits."""

    cache: KVCache | None
    logits: torch.Tensor


class Engine:
    """Decodes up to `rows` sequences at a time with one model; the rest wait in arrival order."""

    def __init__(
        self,
        model: GPT,
        rows: int = 16,
        dtype: torch.dtype | None = None,
        use_cache: bool = True,
        decode: str = "rows",
    ) -> None:
        if decode not in DECODES:
            raise ValueError(f"decode={decode!r}: expected one of {', '.join(DECODES)}")
        self.model, self.capacity, self.dtype, self.use_cache = model, rows, dtype, use_cache
        self.device = next(model.parameters()).device
        self.block = model.config.block_size
        self.cache = (RowCache if decode == "rows" else StaticCache)(model.config, rows, self.device)
        self._decode = _compiled_step(model, self.device.type) if decode == "compiled" else forward_logits
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence] = []  # row i of the cache
        self.past: list[Sequence] = []  # past the context (or uncached): each recomputes its window a step
        self.joining: list[tuple[Sequence, KVCache | None]] = []  # prefilled last step, in the batch from this one
        self._sharing: Counter[Hashable] = Counter()  # sequences still to take each prompt's prefill
        self._prefills: dict[Hashable, _Prefill] = {}

    @property
    def active(self) -> list[Sequence]:
        return [*self.rows, *self.past, *(seq for seq, _ in self.joining)]

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def _precision(self) -> contextlib.AbstractContextManager:
        """Autocast to `dtype`; with none, the caller's precision (its own autocast, if any) holds."""
        return contextlib.nullcontext() if self.dtype is None else autocast(self.device, self.dtype)

    def submit(self, *sequences: Sequence) -> None:
        for seq in sequences:
            if not seq.ids:
                raise ValueError("a prompt must have at least one token")
        for seq in sequences:
            if seq.max_new_tokens <= 0:
                self._end(seq, LENGTH)
                continue
            if seq.prompt_key is not None:
                self._sharing[seq.prompt_key] += 1
            self.waiting.append(seq)

    def run(self, *sequences: Sequence) -> list[Sequence]:
        """Submit `sequences` and step until nothing is left; returns them."""
        self.submit(*sequences)
        while self.busy:
            self.step()
        return list(sequences)

    @torch.no_grad()
    def step(self) -> None:
        """One token for every sequence: those that joined take their next in the batch's forward, and the waiting
        sequences that fit take their first from their prompt's prefill."""
        joined, self.joining = self.joining, []
        for seq, cache in joined:
            if cache is not None:
                self.cache.add(cache)
                self.rows.append(seq)
            else:
                self._slide(seq)
        for seq in [s for s in self.rows if len(s.ids) - 1 == self.block]:  # its cache holds all but its last id
            self._drop_row(seq)
            self._slide(seq)
        while self.waiting and len(self.active) < self.capacity:
            self._enter(self.waiting.popleft())
        rows, groups = list(self.rows), _by_length(self.past, self.block)
        past = [s for group in groups for s in group]
        if not rows and not past:
            return
        logits = []
        with self._precision():
            if rows:
                logits.append(self._decode_rows(rows))
            for group in groups:  # a batch of windows needs one length
                idx = torch.tensor([s.ids[-self.block :] for s in group], device=self.device)
                logits.append(forward_logits(self.model, idx, None)[:, -1])
        # One draw for all: a draw per row paid sample_rows' fixed cost once for each.
        batch = logits[0] if len(logits) == 1 else torch.cat(logits)
        for seq, token in zip(rows + past, self._sample(rows + past, batch), strict=True):
            self._take(seq, token)

    def _decode_rows(self, rows: list[Sequence]) -> torch.Tensor:
        """The rows' next-token logits, one forward over the cache."""
        last = [s.ids[-1] for s in rows]
        if isinstance(self.cache, StaticCache):
            batch = min(1 << (len(rows) - 1).bit_length(), self.capacity)  # a compiled size, padded
            self.cache.decode(batch)
            last += [0] * (batch - len(rows))
        idx = torch.tensor(last, device=self.device)[:, None]
        return self._decode(self.model, idx, self.cache)[: len(rows), -1]

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out (waiting or in the batch) without ending it: its row is freed; a no-op if it is gone."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._release(seq)
        elif seq in self.past:
            self.past.remove(seq)
        elif seq in (joining := [s for s, _ in self.joining]):
            del self.joining[joining.index(seq)]
        elif seq in self.rows:
            self._drop_row(seq)

    def _enter(self, seq: Sequence) -> None:
        prefill = self._prefill(seq)
        token = self._sample([seq], prefill.logits[None])[0]
        if not self._take(seq, token):
            self.joining.append((seq, prefill.cache if self.use_cache else None))

    def _prefill(self, seq: Sequence) -> _Prefill:
        """The prompt's cache and logits, computed by the first sequence of its key and shared by the others."""
        prefill = self._prefills.get(seq.prompt_key) if seq.prompt_key is not None else None
        if prefill is None:
            cached = self.use_cache and len(seq.ids) < self.block
            cache = KVCache(self.model.config, 1, self.device) if cached else None
            idx = torch.tensor([seq.ids[-self.block :]], device=self.device)
            with self._precision():
                prefill = _Prefill(cache, forward_logits(self.model, idx, cache)[0, -1])
            if seq.prompt_key is not None:
                self._prefills[seq.prompt_key] = prefill
        self._release(seq)
        return prefill

    def _release(self, seq: Sequence) -> None:
        """`seq` no longer needs its prompt's prefill: the last one frees it."""
        key = seq.prompt_key
        if key is None or not self._sharing[key]:
            return
        self._sharing[key] -= 1
        if not self._sharing[key]:
            del self._sharing[key]
            self._prefills.pop(key, None)

    def _slide(self, seq: Sequence) -> None:
        if seq.slides or not self.use_cache and len(seq.ids) <= self.block:
            self.past.append(seq)
        else:
            self._end(seq, LENGTH)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Each sequence's next token by its own rule and random stream; a greedy one draws nothing."""
        uniforms = None
        if not all(s.rule.greedy for s in seqs):
            draw = functools.partial(torch.rand, (), dtype=torch.float64, device=logits.device)
            unused = torch.zeros((), dtype=torch.float64, device=logits.device)
            uniforms = torch.stack([unused if s.rule.greedy else draw(generator=s.generator) for s in seqs])
        return sample_rows(logits, [s.rule for s in seqs], uniforms).tolist()

    def _take(self, seq: Sequence, token: int) -> bool:
        """Add `token` to `seq`; True when that ended it (it has then left the batch)."""
        seq.ids.append(token)
        stop = token in seq.ends
        watched = seq.watch(seq, token, stop) if seq.watch else False
        if stop or watched:
            self.remove(seq)
            self._end(seq, STOP)
        elif len(seq.ids) - seq.prompt_tokens >= seq.max_new_tokens:
            self.remove(seq)
            self._end(seq, LENGTH)
        return seq.finish is not None

    def _end(self, seq: Sequence, reason: str) -> None:
        seq.finish = reason
        if seq.ended:
            seq.ended(seq)

    def _drop_row(self, seq: Sequence) -> None:
        """Free `seq`'s row: the last row in use moves into it."""
        row = self.rows.index(seq)
        self.cache.remove(row)
        last = self.rows.pop()
        if row < len(self.rows):
            self.rows[row] = last


def _by_length(seqs: list[Sequence], block: int) -> list[list[Sequence]]:
    """`seqs` grouped by the length of their last-`block` window, in order of first appearance."""
    groups: dict[int, list[Sequence]] = {}
    for seq in seqs:
        groups.setdefault(min(len(seq.ids), block), []).append(seq)
    return list(groups.values())


CPU_OPTIONS = {"size_asserts": False, "cpp_wrapper": True}
ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters  # torch >= 2.13: graphs kept apart
_STEPS: dict[tuple, Callable] = {}


def _compiled_step(model: GPT, device_type: str) -> Callable:
    """`forward_logits` compiled (each batch size a graph of its own); on CUDA captured in CUDA graphs, as the step
    is launch-bound there. On CPU without inductor's checks of each input's size and stride, which Dynamo's guards
    have made already (12% of the demo model's step), and with its kernels called from C++, not Python (8%). Where
    torch keeps a compile's graphs to itself, each model structure (`_structure`) gets its own, and Dynamo skips
    its guards on the model's modules at each call (22 -> 5 us, 7%): what they check is the structure. Not
    fullgraph: past torch's limit of graphs a function (8: a few models' batch sizes) the step runs eagerly, where
    fullgraph failed every request of a server from then on."""
    key = _structure(model) if device_type == "cpu" and ISOLATES else None
    if key is None:
        return _shared_step(device_type)
    if key not in _STEPS:
        options = {**CPU_OPTIONS, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        _STEPS[key] = torch.compile(forward_logits, dynamic=False, options=options, isolate_recompiles=True)
    return _STEPS[key]


@functools.cache
def _shared_step(device_type: str) -> Callable:
    """One compile for every model: Dynamo's guards tell their graphs apart."""
    if device_type == "cuda":
        return torch.compile(forward_logits, dynamic=False, mode="reduce-overhead")
    return torch.compile(forward_logits, dynamic=False, options=CPU_OPTIONS)


def _structure(model: GPT) -> tuple | None:
    """All a forward reads from `model` but its tensors' values: each module's class, plain attributes (the
    model's config among them) and tensors' shapes, strides, dtypes and devices. None with forward hooks, which
    only Dynamo's guards on the modules follow."""
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return None
    parts: list = []
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return None
        plain = []
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                plain.append((key, _layout(value)))
            elif not key.startswith("_"):
                plain.append((key, repr(value)))
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        parts.append((name, type(module), tuple(plain), tuple((key, _layout(t)) for key, t in tensors)))
    return tuple(parts)


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


@torch.no_grad()
def column_major(model: GPT) -> GPT:
    """Store each linear weight column-major (the same values, its transpose contiguous): on CPU, MKL multiplies
    one row (a decoded token) by such a weight ~2.7x as fast (the demo model decoded 1.3x as fast, the same
    tokens). For inference only: an optimizer's state would not share the layout."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.t().contiguous().t()  # a tied table is the same parameter
    return model
