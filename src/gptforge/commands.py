"""What each `gptforge` subcommand does with its parsed arguments; cli.py builds the parser and runs one."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from gptforge.errors import GptforgeError
from gptforge.files import to_json


def cmd_prepare(args: argparse.Namespace) -> None:
    from gptforge.data.chat.prepare import chat_form
    from gptforge.data.clean.dedup import DedupSettings
    from gptforge.data.clean.quality import QualitySettings
    from gptforge.data.engine import EngineSettings
    from gptforge.data.prepare import prepare
    from gptforge.data.prepare_settings import PrepareSettings
    from gptforge.data.report import summarize

    dedup = DedupSettings(
        mode=args.dedup,
        shingle=args.dedup_shingle,
        hashes=args.dedup_hashes,
        bands=args.dedup_bands,
        threshold=args.dedup_threshold,
    )
    # A text field named on the command line says the rows are documents, whatever else they hold.
    jsonl = args.source.endswith((".jsonl", ".jsonl.gz")) and args.text_field is None
    form = chat_form(args.source) if not args.chat and jsonl else None
    if form:
        print(f"{args.source}: conversations ({form}): preparing them for fine-tuning, as --chat does", flush=True)
    if args.chat or form:
        _prepare_chat(args, dedup)
        return
    settings = PrepareSettings.from_flags(
        args.source,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        text_field=args.text_field,
        decontaminate=args.decontaminate,
        seed=args.seed,
        dedup=dedup,
        clean=args.clean,
        clean_set=args.clean_set,
        ext=args.ext,
        quality=QualitySettings(args.quality, args.quality_threshold, args.quality_labels),
    )
    engine = EngineSettings(args.engine, args.tasks, args.executor, args.slurm_partition, args.slurm_time)
    manifest = prepare(settings, args.out, workers=args.workers, force=args.force, engine=engine)
    print(summarize(manifest, args.out))


def _prepare_chat(args: argparse.Namespace, dedup) -> None:
    from gptforge.data.chat.prepare import ChatSettings, prepare_chat

    why = {
        "--train-tokenizer": (args.train_tokenizer is not None, "fine-tuning keeps the base model's tokenizer"),
        "--clean": (args.clean != "none", "the quality filters judge documents, not conversations"),
        "--clean-set": (bool(args.clean_set), "the quality filters judge documents, not conversations"),
        "--ext": (args.ext is not None, "conversations are read from .jsonl files"),
        "--text-field": (args.text_field is not None, "a conversation's text is in its messages"),
        "--workers": (args.workers is not None, "conversations are prepared in one process"),
        "--quality": (args.quality is not None, "the quality classifier scores documents, not conversations"),
        "--quality-labels": (args.quality_labels is not None, "the quality classifier scores documents"),
        "--quality-threshold": (args.quality_threshold is not None, "the quality classifier scores documents"),
    }
    engine = ("--engine", "--tasks", "--executor", "--slurm-partition", "--slurm-time")
    defaults = ("local", 1, "local", "", "24:00:00")
    for flag, default in zip(engine, defaults, strict=True):
        given = getattr(args, flag[2:].replace("-", "_")) != default
        why[flag] = (given, "conversations are prepared in this process, not by datatrove")
    for flag, (given, reason) in why.items():
        if given:
            raise GptforgeError(f"{flag}: does not apply to conversations ({reason})")
    settings = ChatSettings(
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        seed=args.seed,
        dedup=dedup,
        decontaminate=tuple(args.decontaminate),
        shard_tokens=args.shard_tokens,
    )
    manifest = prepare_chat(args.source, args.out, settings.checked(), force=args.force)
    train, val = (manifest["splits"][s] for s in ("train", "val"))
    removed = ", ".join(f"{n:,} {why}" for why, n in manifest["removed"].items()) or "none"
    print(
        f"wrote {args.out}: {train['docs']:,} training conversations ({train['assistant_tokens']:,} of "
        f"{train['tokens']:,} tokens in the loss), {val['docs']:,} held out; removed: {removed}; "
        f"report: {args.out}/report.md"
    )


def cmd_train(args: argparse.Namespace) -> None:
    from gptforge.checkpoint import latest_checkpoint
    from gptforge.config import describe, load_config
    from gptforge.demo import wrap_up
    from gptforge.runtime.distributed import elastic_resume, elastic_warning, launch_env, launcher_overrides
    from gptforge.train.checkpointer import resume_config
    from gptforge.train.setup import check_init_overrides
    from gptforge.train.trainer import train

    if args.help_config:
        print(describe())
        return
    overrides, note = launcher_overrides([*args.set, *([f"data.path={args.data}"] if args.data else [])], os.environ)
    resume, restarted = elastic_resume(args.resume, os.environ, saved=latest_checkpoint(args.out) is not None)
    for line in (note, restarted, elastic_warning(os.environ)):
        if line:
            print(line, flush=True)
    if resume and args.config is None:  # continue with the run's own settings, changed only by --set/--data
        cfg = resume_config(Path(args.out), resume, overrides)
    else:
        cfg = load_config(args.config or "demo-cpu", overrides)
    check_init_overrides(cfg, overrides)
    result = train(cfg, args.out, resume=resume)
    if launch_env(os.environ).is_main:  # one process draws and says what next
        print(wrap_up(result, Path(args.out), Path(result.config.data.path or "DATA_DIR")))


def cmd_rl(args: argparse.Namespace) -> None:
    from gptforge.config import load_config
    from gptforge.report.rl_plot import plot_rl
    from gptforge.runtime.distributed import launch_env
    from gptforge.train.checkpointer import resume_config
    from gptforge.train.rl import train_rl

    if args.resume and args.config is None:
        cfg = resume_config(Path(args.out), args.resume, args.set)
    else:
        cfg = load_config(args.config or "rl-cpu", args.set)
    result = train_rl(cfg, args.out, resume=args.resume)
    if launch_env(os.environ).is_main:
        print(f"wrote {plot_rl(result.run_dir).path}; chat with it: gptforge chat {shlex.quote(str(result.run_dir))}")


def cmd_eval(args: argparse.Namespace) -> None:
    from gptforge.eval.suite import evaluate_checkpoint, format_results
    from gptforge.runtime.threads import use_threads

    use_threads(args.threads or 0)

    result = evaluate_checkpoint(
        args.checkpoint,
        data=args.data,
        text=args.text,
        hellaswag=args.hellaswag,
        limit=args.limit,
        max_tokens=args.tokens,
        batch_size=args.batch_size,
        device_name=args.device,
        humaneval=args.humaneval,
        samples=args.samples,
        ks=args.k,
        temperature=args.temperature,
        dtype=args.dtype,
        lm_eval=args.lm_eval,
        include_path=args.include_path,
        code=args.code,
        tasks=args.tasks,
    )
    print(to_json(result) if args.json else format_results(result))


def _need_open(*streams: str) -> None:
    """A stream closed as the command started (`>&-`, `<&-`) is None in Python: print() to it drops every line
    without a word and input() fails with a traceback, so say so before loading anything."""
    for name in streams:
        if getattr(sys, name) is None:
            raise GptforgeError(f"{name} is closed: give it a terminal, a file or /dev/null")


def cmd_sample(args: argparse.Namespace) -> None:
    from gptforge.model.engine import Decoding
    from gptforge.runtime.threads import use_threads
    from gptforge.sample import sample_texts

    _need_open("stdout")
    use_threads(args.threads or 0)

    pieces = sample_texts(
        args.checkpoint,
        args.prompt or [""],
        num_samples=args.num_samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        seed=args.seed,
        device=args.device,
        use_cache=not args.no_cache,
        dtype=args.dtype,
        suffix=args.suffix,
        chat=args.chat,
        decoding=Decoding(args.weights, args.decode),
    )
    at_line_start = True
    try:
        for piece in pieces:
            print(piece, end="", flush=True)
            at_line_start = piece.endswith("\n") if piece else at_line_start
    finally:
        if not at_line_start:  # an error or Ctrl-C mid-sample starts its message on a line of its own
            print(flush=True)


def cmd_chat(args: argparse.Namespace) -> None:
    from gptforge.model.engine import Decoding
    from gptforge.runtime.threads import use_threads
    from gptforge.sample import ChatSettings, chat_session, echoed

    _need_open("stdin", "stdout")
    use_threads(args.threads or 0)
    settings = ChatSettings(
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        seed=args.seed,
    )
    read = input if sys.stdin.isatty() else echoed
    decoding = Decoding(args.weights, args.decode)
    chat_session(args.checkpoint, settings, read=read, device=args.device, dtype=args.dtype, decoding=decoding)


def cmd_export(args: argparse.Namespace) -> None:
    from gptforge.hub.publish import export_adapter, export_checkpoint, export_gguf

    if args.format == "peft":
        for flag in ("push", "branch", "message", "gguf_type"):
            if getattr(args, flag):
                raise GptforgeError(f"--{flag.replace('_', '-')}: not with --format peft")
        _refuse_gguf_name(args.out)  # a PEFT folder is a Hugging Face one
        print(export_adapter(args.checkpoint, args.out, args.force))
        return
    if args.format == "gguf":
        for flag in ("push", "branch", "message"):
            if getattr(args, flag):
                raise GptforgeError(f"--{flag}: only with --format hf (commit a GGUF file to a repository yourself)")
        print(export_gguf(args.checkpoint, args.out, args.gguf_type or "f32", args.force))
        return
    if args.gguf_type:
        raise GptforgeError(f"--gguf-type {args.gguf_type}: only with --format gguf")
    _refuse_gguf_name(args.out)
    for line in export_checkpoint(args.checkpoint, args.out, args.push, args.branch, args.message, args.force):
        print(line)


def _refuse_gguf_name(out: str) -> None:
    if Path(out).suffix.lower() == ".gguf":
        raise GptforgeError(f"--out {out}: a .gguf name for a Hugging Face folder; add --format gguf")


def cmd_import(args: argparse.Namespace) -> None:
    from gptforge.hub.publish import import_checkpoint

    print(import_checkpoint(args.hf_dir, args.out, args.force))


def cmd_bench(args: argparse.Namespace) -> None:
    from gptforge.bench import format_bench, run_bench
    from gptforge.config import load_config

    r = run_bench(load_config(args.config, args.set), args.steps, args.warmup, reference=not args.no_reference)
    print(to_json(r) if args.json else format_bench(r, args.config))


def cmd_plan(args: argparse.Namespace) -> None:
    from gptforge.config import load_config
    from gptforge.train.plan import Hardware, format_report, report

    cfg = load_config(args.config, args.set)
    hardware = Hardware(args.gpus, args.nodes, args.gpu_memory, args.peak_tflops, args.mfu)
    r = report(cfg, " ".join([args.config, *(f"--set {s}" for s in args.set)]), hardware)
    print(to_json(r) if args.json else format_report(r))


def cmd_plot(args: argparse.Namespace) -> None:
    from gptforge.report.plot import plot_runs
    from gptforge.report.rl_plot import is_rl_run, plot_rl

    if len(args.run_dirs) == 1 and is_rl_run(args.run_dirs[0]):
        print(f"wrote {plot_rl(args.run_dirs[0], args.out).path}")
        return
    print(f"wrote {plot_runs(args.run_dirs, args.out).path}")


def cmd_report(args: argparse.Namespace) -> None:
    from gptforge.report.summary import run_report

    print(run_report(args.run_dir), end="")


def cmd_demo(args: argparse.Namespace) -> None:
    from gptforge.demo import run_chat_demo, run_demo

    if args.rl_budget is not None and not args.chat:
        raise GptforgeError("--rl-budget: only with --chat (RL trains the fine-tuned chat model)")
    if args.chat:
        if args.config:
            raise GptforgeError("--config: with --chat the fine-tuning recipe is chat-cpu (change it with --set)")
        run_chat_demo(
            args.base, args.data, args.out or "runs/demo-chat", args.time_budget, args.set, args.force, args.rl_budget
        )
        return
    run_demo(
        "runs/demo" if args.out is None else args.out, args.data, args.time_budget, args.set, args.force, args.config
    )


def cmd_speedrun(args: argparse.Namespace) -> None:
    from gptforge.config import preset_path
    from gptforge.speedrun import format_summary, speedrun

    recipes = {"gpt2": args.gpt2_config, "modern": args.modern_config}
    for recipe, preset in recipes.items():
        preset_path(preset, f"--{recipe}-config")  # a wrong name is refused under its own flag
    summary = speedrun(args.out, args.budget, args.seeds, args.data, recipes, args.set, args.force)
    print(to_json(summary) if args.json else format_summary(summary))


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        from gptforge.serve.app import serve
        from gptforge.serve.protocol import Limits
    except ImportError as e:  # the optional extra is not installed
        raise GptforgeError(f"serve needs its extra: pip install 'gptforge[serve]' (missing {e.name})") from None
    from gptforge.model.engine import Decoding

    limits = Limits(
        max_tokens=args.max_tokens,
        max_n=args.max_n,
        parallel=args.parallel,
        queue=args.queue,
        request_timeout=args.request_timeout,
        read_timeout=args.read_timeout,
    )
    serve(
        args.path,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        limits=limits,
        cors=tuple(args.cors),
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        allow_hosts=tuple(args.allow_host),
        decoding=Decoding(args.weights, args.decode),
    )
