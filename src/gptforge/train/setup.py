"""What a run trains with, built from its config: the resolved config, model, optimizer, scaler and step size.

The trainer and `gptforge bench` both build through `build`, so the bench times the trainer's own setup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptforge.checkpoint import META, load_checkpoint, quiet_model, read_meta, resolve_checkpoint
from gptforge.config import Config, config_from_dict
from gptforge.config.sections import AUTO_PROMPT
from gptforge.data.fim import FIM
from gptforge.data.loader import TokenLoader
from gptforge.data.mixture import MixtureLoader, Source, open_mix, parse_mix
from gptforge.data.shards import fingerprint, read_manifest
from gptforge.data.tokenizer import check_data_tokenizer
from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.runtime import dtype_name
from gptforge.runtime.device import DTYPES, physical_memory, resolve_dtype, setup_fast_math
from gptforge.runtime.distributed import DistEnv, broadcast_int, wrap
from gptforge.runtime.flops import format_flops, peak_flops
from gptforge.runtime.fsdp import is_sharded, shard, whole_weights
from gptforge.runtime.threads import busy_warning, use_threads
from gptforge.tokens.fim import FIMTokenizer, with_fim
from gptforge.tokens.tokenizer import Tokenizer, load_tokenizer
from gptforge.train.finetune import adapt, chat_tokenizer, check_fim, fit_vocabulary, packed_model, template_name
from gptforge.train.optim import build_optimizer, lr_at
from gptforge.train.plan import GIB, check_fits, grad_accumulation


@dataclass
class Data:
    """The prepared corpus a run reads: one folder (`data.path`) or a weighted mix of several (`data.mix`), their
    manifests and the tokenizer they were made with."""

    sources: list[Source]
    manifests: list[dict[str, Any]]
    tokenizer: Tokenizer
    mixed: bool

    @property
    def has_val(self) -> bool:
        return any(s["split"] == "val" for m in self.manifests for s in m["shards"])

    @property
    def folders(self) -> list[str]:
        return [s.path for s in self.sources]

    @property
    def fingerprint(self) -> str:
        """What a checkpoint records of the data's content (a resume warns when it changed)."""
        if not self.mixed:
            return fingerprint(self.manifests[0])
        return ",".join(f"{s.name}:{fingerprint(m)}" for s, m in zip(self.sources, self.manifests, strict=True))

    def changed_since(self, saved: str | None) -> list[str]:
        """The folders whose shards differ from those a checkpoint's `fingerprint` records. A folder added to or
        dropped from a mix, or a switch between a mix and one folder, changes no folder's shards."""
        if saved is None or saved == self.fingerprint or (":" in saved) != self.mixed:
            return []
        if not self.mixed:
            return self.folders
        before = dict(re.findall(r"(.*?):([0-9a-f]{16})(?:,|$)", saved))  # NAME:FINGERPRINT, ... (a name may hold ',')
        now = [(s, fingerprint(m)) for s, m in zip(self.sources, self.manifests, strict=True)]
        return [s.path for s, mark in now if before.get(s.name, mark) != mark]


def open_data(cfg: Config) -> Data:
    """The folder or mix the config names, refused in one line if missing, unprepared or of mixed tokenizers."""
    if cfg.data.mix:
        sources = parse_mix(cfg.data.mix)
        tokenizer, manifests = open_mix(sources)
        tokenizer = chat_tokenizer(with_fim(tokenizer, cfg.data.fim_rate), template_name(cfg, manifests, None))
        return Data(sources, manifests, tokenizer, mixed=True)
    if not cfg.data.path:
        raise GptforgeError("no training data: pass --data DIR (a folder written by `gptforge prepare`) or data.mix")
    manifest = read_manifest(cfg.data.path)
    tokenizer = with_fim(load_tokenizer(manifest["tokenizer"]["name"], cfg.data.path), cfg.data.fim_rate)
    tokenizer = chat_tokenizer(tokenizer, template_name(cfg, [manifest], None))
    return Data(parse_mix([f"{cfg.data.path}=1"]), [manifest], tokenizer, mixed=False)  # a one-folder mix


def train_loader(cfg: Config, data: Data, env: DistEnv) -> TokenLoader | MixtureLoader:
    """This rank's training batches: the folder's `TokenLoader`, or a `MixtureLoader` over the mix."""
    shape = {"batch_size": cfg.train.micro_batch, "seq_len": cfg.model.block_size}
    where = {"rank": env.rank, "world_size": env.world_size, "seed": cfg.train.seed, "shuffle": cfg.data.shuffle}
    where["step_windows"] = cfg.train.batch_tokens // cfg.model.block_size  # epochs the same for any world size
    if isinstance(data.tokenizer, FIMTokenizer):
        where["fim"] = FIM(data.tokenizer, cfg.data.fim_rate, cfg.data.fim_spm_rate)
    if data.mixed:
        return MixtureLoader(data.sources, "train", **shape, **where)
    return TokenLoader(cfg.data.path, "train", **shape, **where)


def check_resume_tokenizer(ckpt: Path, tokenizer: Tokenizer, data_dir: str) -> None:
    """Refuse resuming checkpoint `ckpt` on data made with another tokenizer than its own."""
    try:
        name = json.loads((ckpt / META).read_text())["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GptforgeError(f"{ckpt / META}: malformed checkpoint metadata ({e})") from None
    check_data_tokenizer(tokenizer, data_dir, load_tokenizer(name, ckpt), f"checkpoint {ckpt}")


# Model options that change neither the weights nor what they compute at evaluation: a run keeps its own.
RUN_OWN_MODEL_KEYS = ("fused_loss", "activation_checkpointing", "dropout")


def check_init_overrides(cfg: Config, overrides: list[str]) -> None:
    """Refuse `--set model.KEY=VALUE` that train.init_from's architecture would replace without a word."""
    if cfg.train.init_from and model_overrides(overrides):
        saved = config_from_dict(read_meta(resolve_checkpoint(cfg.train.init_from))["config"]).model
        check_model_overrides(cfg.model, saved, overrides, f"train.init_from={cfg.train.init_from}")


def model_overrides(overrides: list[str]) -> list[str]:
    """The model keys `--set` names that a fine-tuning run cannot change: its base's architecture decides them."""
    keys = {item.partition("=")[0].strip().removeprefix("model.") for item in overrides if item.startswith("model.")}
    return sorted(keys - {*RUN_OWN_MODEL_KEYS, "vocab_size"})


def check_model_overrides(model: GPTConfig, saved: GPTConfig, overrides: list[str], base: str) -> None:
    """Refuse each `--set model.KEY` whose value differs from the base's `saved` architecture."""
    for key in model_overrides(overrides):
        ours, theirs = getattr(model, key), getattr(saved, key)
        if ours != theirs:
            raise GptforgeError(
                f"--set model.{key}={ours}: {base} decides the architecture and its {key} is {theirs} (a run "
                f"sets only model.{', model.'.join(RUN_OWN_MODEL_KEYS)} of its own)"
            )


# eval.prompt "auto": a sample prompt in the data's main language; the others (prose, web text) start a fresh document.
PROMPTS = {
    "Python": "def fibonacci(n):",
    "C": "int fibonacci(int n)\n{",
    "C++": "int fibonacci(int n) {",
    "CUDA": "__global__ void add(const float *a, const float *b, float *c, int n)\n{",
    "Java": "public static int fibonacci(int n) {",
    "C#": "public static int Fibonacci(int n)\n{",
    "JavaScript": "function fibonacci(n) {",
    "TypeScript": "function fibonacci(n: number): number {",
    "Go": "func fibonacci(n int) int {",
    "Rust": "fn fibonacci(n: u64) -> u64 {",
    "Ruby": "def fibonacci(n)",
    "PHP": "function fibonacci($n) {",
    "Shell": "#!/bin/sh\n",
    "SQL": "SELECT",
}


def sample_prompt(manifests: list[dict[str, Any]]) -> str:
    """The prompt for eval.prompt "auto": PROMPTS' for the language of most kept documents (prepare's report counts
    them), else "" (a fresh document)."""
    kept: dict[str, int] = {}
    for manifest in manifests:
        for language, counts in manifest.get("report", {}).get("languages", {}).items():
            kept[language] = kept.get(language, 0) + counts["kept"]
    main = max(kept, key=kept.__getitem__, default=None)
    return PROMPTS.get(main, "")


def resolve_config(
    cfg: Config, data: Data, resume_from: Path | None = None
) -> tuple[Config, dict[str, torch.Tensor] | None]:
    """The config the run trains with, and `train.init_from`'s weights if any; `cfg` itself is left unchanged.

    The data decides the vocabulary and an "auto" sample prompt; an init_from checkpoint decides the architecture
    (RUN_OWN_MODEL_KEYS stay the run's own, as nanoGPT keeps its dropout).
    """
    model_cfg, weights, tokenizer, init_cfg = cfg.model, None, data.tokenizer, None
    execution = {key: getattr(cfg.model, key) for key in RUN_OWN_MODEL_KEYS}
    if cfg.train.init_from and resume_from is not None:  # its checkpoint holds every weight: the base may be gone
        init_cfg = config_from_dict(read_meta(resume_from)["config"])
        model_cfg = dataclasses.replace(init_cfg.model, **execution)
    elif cfg.train.init_from:
        init_model, init_tok, init_cfg, _ = load_checkpoint(cfg.train.init_from)
        check_data_tokenizer(tokenizer, ", ".join(data.folders), init_tok, f"train.init_from={cfg.train.init_from}")
        model_cfg, weights = dataclasses.replace(init_cfg.model, **execution), init_model.state_dict()
    template = template_name(cfg, data.manifests, init_cfg)  # a chat model stays one
    check_fim(cfg, init_cfg, template)
    data.tokenizer = tokenizer = chat_tokenizer(tokenizer, template)
    model_cfg = dataclasses.replace(
        packed_model(model_cfg, data.manifests, tokenizer.eot), vocab_size=tokenizer.vocab_size
    )
    weights = fit_vocabulary(weights, model_cfg) if weights is not None else None
    lr_at(0, cfg.optim, 1)  # an unknown schedule fails now, not after the first evaluation
    # Absolute data paths, so config.toml and checkpoints still find the data from another working directory.
    path = str(Path(cfg.data.path).resolve()) if cfg.data.path else ""
    mix = [f"{os.path.abspath(s.path)}={s.weight}" for s in parse_mix(cfg.data.mix)]  # links kept: they name folders
    data_cfg = dataclasses.replace(cfg.data, path=path, mix=mix, chat_template=template)
    prompt = sample_prompt(data.manifests) if cfg.eval.prompt == AUTO_PROMPT else cfg.eval.prompt
    eval_cfg = dataclasses.replace(cfg.eval, prompt=prompt)
    # As data.path: an absolute base, so a resume from another working directory still finds it.
    train_cfg = dataclasses.replace(
        cfg.train, init_from=os.path.abspath(cfg.train.init_from) if cfg.train.init_from else ""
    )
    return dataclasses.replace(cfg, model=model_cfg, data=data_cfg, eval=eval_cfg, train=train_cfg), weights


def resolve_precision(cfg: Config, device: torch.device, env: DistEnv, resume_from: Path | None) -> Config:
    """train.dtype 'auto' made concrete, so config.toml and checkpoints say what ran: on resume the checkpoint's, in
    a fine-tuning the base's (what it learned in), else this machine's pick (rank 0's on CPU, where it is
    measured, so that every rank computes alike)."""
    if cfg.train.dtype != "auto":
        return cfg
    source = resume_from or (resolve_checkpoint(cfg.train.init_from) if cfg.train.init_from else None)
    saved = read_meta(source)["config"]["train"].get("dtype", "auto") if source else "auto"
    name = saved if saved != "auto" else dtype_name(resolve_dtype("auto", device))
    if device.type == "cpu" and env.distributed:
        name = list(DTYPES)[broadcast_int(list(DTYPES).index(name), env, device)]
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=name))


def check_model_fits(model_cfg: GPTConfig) -> None:
    """Refuse a model whose fp32 weights alone exceed this machine's memory (every model is built there first)."""
    need, have = 4 * model_cfg.num_weights, physical_memory()
    if have and need > have:
        raise GptforgeError(
            f"the model has {model_cfg.num_weights:,} parameters ({need / 2**30:,.1f} GiB in fp32), more than this "
            f"machine's {have / 2**30:,.1f} GiB of memory: lower model.n_layer, model.n_embd, model.vocab_multiple "
            "or model.block_size"
        )


@dataclass
class TrainSetup:
    model: GPT
    """The weights: evaluation, sampling and checkpoints use this module."""
    train_model: torch.nn.Module
    """The same weights as trained: compiled and/or wrapped in DDP as the config asks."""
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device
    dtype: torch.dtype
    grad_accum: int
    peak_flops: float
    """Peak FLOP/s of one device, for MFU (0: unknown)."""
    peak_source: str
    notes: tuple[str, ...] = ()
    """Lines the run header adds: a warning when the CPU's matmuls run far below an idle machine's speed."""

    @contextlib.contextmanager
    def whole_model(self) -> Iterator[GPT]:
        """The model with all its weights on this process (evaluation, sampling, exports): itself, or under fsdp
        a copy gathered from the shards for the block's duration. Every process must enter it."""
        if not is_sharded(self.model):
            yield self.model
            return
        weights = whole_weights(self.model)
        copy = quiet_model(self.model.config).to(self.device)
        copy.load_state_dict(weights)
        copy.train(self.model.training)
        del weights
        yield copy


def build(
    cfg: Config, env: DistEnv, device: torch.device, weights: dict[str, torch.Tensor] | None = None
) -> TrainSetup:
    """Model (seeded, the same on every rank), optimizer, loss scaler and step size for a resolved config."""
    dtype = resolve_dtype(cfg.train.dtype, device)
    setup_fast_math(device)
    if device.type == "cpu":
        use_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
    grad_accum = grad_accumulation(cfg, env.world_size)
    check_model_fits(cfg.model)
    if device.type == "cuda":  # refused now in one line, not by an out-of-memory error minutes later
        check_fits(cfg, env.world_size, torch.cuda.get_device_properties(device).total_memory / GIB)
    model = GPT(cfg.model)
    if weights is not None:
        model.load_state_dict(weights)
    adapters = adapt(model, cfg)  # LoRA: adapters on the loaded weights, which stay frozen
    model.to(device)
    notes = [adapters] if adapters else []
    if cfg.train.parallel == "fsdp" and env.distributed:
        shard(model, model.transformer.h, device, dtype, cfg.train.reshard_after_forward)
        train_model = torch.compile(model) if cfg.train.compile else model
    else:
        train_model = wrap(torch.compile(model) if cfg.train.compile else model, env, device)
    if cfg.train.parallel == "fsdp" and not env.distributed:
        in_step = " (checkpoint.async_save too: each checkpoint is written in step)" * cfg.checkpoint.async_save
        notes.append(f"train.parallel=fsdp with one process: nothing to shard, it trains as one process would{in_step}")
    optimizer = build_optimizer(model, cfg.optim, device.type, cfg.train.zero and env.distributed, dtype)
    # fp16 (GPUs without bf16) needs loss scaling; for bf16 and fp32 the scaler is a pass-through.
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16 and device.type == "cuda")
    peak, peak_source = peak_flops(device, dtype, cfg.train.peak_flops)
    slow = busy_warning(peak, dtype) if device.type == "cpu" and not cfg.train.peak_flops else None
    notes += [slow] if slow else []
    return TrainSetup(model, train_model, optimizer, scaler, device, dtype, grad_accum, peak, peak_source, tuple(notes))


def run_header(cfg: Config, s: TrainSetup, tokenizer_name: str, world: int) -> str:
    """The run header: model size and shape, devices and precision, how the token batch is made up."""
    B, T = cfg.train.micro_batch, cfg.model.block_size
    # Launchers set OMP_NUM_THREADS (torchrun and accelerate to 1 unless told): a CPU run says what it got.
    n = torch.get_num_threads()
    threads = f", {n} thread{'s' if n > 1 else ''} each" if s.device.type == "cpu" else ""
    return (
        f"model: {s.model.num_params():,} parameters, {s.model.flops_per_token(T) / 1e6:,.0f} MFLOP/token, "
        f"{cfg.model.n_layer} layers, {cfg.model.n_embd} wide, context {T}, vocab {cfg.model.vocab_size} "
        f"({tokenizer_name}) | {world} x {s.device} {dtype_name(s.dtype)}{' compiled' if cfg.train.compile else ''}"
        f"{' fsdp' if is_sharded(s.model) else ''}"
        f"{threads}\n"
        f"batch: {cfg.train.batch_tokens:,} tokens/step = {B} seq x {T} tokens x "
        f"{world} process{'es' if world > 1 else ''} x {s.grad_accum} accumulation | "
        f"MFU against {format_flops(s.peak_flops)} ({s.peak_source})" + "".join(f"\n{note}" for note in s.notes)
    )
