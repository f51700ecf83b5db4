"""`gptforge demo`: prepare the stdlib corpus, train a small code model on CPU, report, sample and plot."""

from __future__ import annotations

import contextlib
import itertools
import math
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from gptforge.checkpoint import (
    META,
    latest_checkpoint,
    load_checkpoint,
    load_for_inference,
    read_meta,
    resolve_checkpoint,
)
from gptforge.config import config_from_dict, load_config
from gptforge.data.chat.doctests import VAL_FRACTION  # the held-out files give held-out mined tasks too
from gptforge.data.chat.instructions import DRILL_SOURCE, conversation_rows, task_rows
from gptforge.data.chat.prepare import ChatSettings, prepare_chat, sources_sha256
from gptforge.data.clean.dedup import DedupSettings
from gptforge.data.outdir import TOKENIZER_FILE
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.report import summarize
from gptforge.data.shards import MANIFEST, read_manifest
from gptforge.data.sources import stdlib_documents
from gptforge.errors import GptforgeError
from gptforge.eval.tasks import BUILTIN, evaluate_tasks, load_tasks
from gptforge.files import LOCK, atomic_write, is_empty_dir, named, replacing_dir, temp_dir_path, to_json, write_json
from gptforge.inputs import read_jsonl
from gptforge.model.generate import generate
from gptforge.outputs import check_output_dir, locked, output_folder
from gptforge.report.plot import plot_runs
from gptforge.report.rl_plot import plot_rl
from gptforge.tasks.builtin import builtin_tasks
from gptforge.tokens.fim import FIMTokenizer, end_ids, infill_prompt
from gptforge.train.rl import train_rl
from gptforge.train.setup import check_model_overrides, model_overrides
from gptforge.train.trainer import TrainResult, train

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(path):", "class Stack:\n    def __init__(self):"]
# A BPE trained on the stdlib packs 3.65 bytes/token against GPT-2's 2.06 on this code, and its small
# output layer leaves the CPU's time to the transformer: the better model per minute (benchmarks/RESULTS.md).
VOCAB_SIZE = 8192
# The modern recipe: on this corpus and budget it beats GPT-2's (demo-cpu, `--config demo-cpu`) at equal time on
# every seed `gptforge speedrun` tried (README, Results).
PRESET = "modern-cpu"
# Shown when the demo trains with fill-in-the-middle (`--set data.fim_rate=0.5`; off by default: at the demo's
# 9 minutes it cost 0.014 bits per byte and infilled no held-out line exactly, benchmarks/RESULTS.md).
INFILL = ("def mean(xs):\n    total = 0\n    for x in xs:", "\n    return total / len(xs)\n")


def run_demo(
    out: str,
    data: str,
    time_budget: float | None,
    overrides: list[str],
    force: bool = False,
    preset: str | None = None,
) -> dict:
    """Train into `out` (new or empty; with `force` a non-empty one is replaced once the new run is complete)."""
    out_dir, data_dir = output_folder(out), output_folder(data, "--data")  # '' would be the current folder
    budget = [] if time_budget is None else [f"train.time_budget={time_budget}"]
    cfg = load_config(preset or PRESET, [*overrides, *budget, f"data.path={data_dir}"])
    check_output_dir(out_dir, force, reads=[data_dir], is_run=True)  # --force replaces the demo's run
    stdlib = PrepareSettings.from_flags("stdlib", val_fraction=VAL_FRACTION, train_tokenizer=VOCAB_SIZE)
    with training_in(out_dir) as run_dir:  # locked first: a demo running there is said before any work
        manifest = prepare(stdlib, data_dir)  # reused when unchanged
        print(summarize(manifest, data_dir).replace("(see report.md)", f"(see {data_dir / 'report.md'})"), flush=True)
        result = train(cfg, run_dir)
    checkpoint = out_dir / result.checkpoint.relative_to(run_dir)

    before, after, vocab = result.first_val, result.last_val, result.config.model.vocab_size
    print("\n=== validation (held-out stdlib files) ===")
    print(f"{'':>10} {'loss':>8} {'ppl':>10} {'bits/byte':>10}")
    print(f"{'uniform':>10} {math.log(vocab):>8.4f} {vocab:>10,}")
    for name, v in (("before", before), ("after", after)):
        print(f"{name:>10} {v['loss']:>8.4f} {v['ppl']:>10.2f} {v['bpb']:>10.3f}")

    model, tok, _, _ = load_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(0)
    completions = []
    print("\n=== completions (temperature 0.6, top-k 50) ===")
    for prompt in PROMPTS:
        new = generate(model, tok.encode(prompt), 96, temperature=0.6, top_k=50, eot=tok.eot, generator=g)[0]
        completions.append(prompt + tok.decode(new))
        print(f"--- {prompt.splitlines()[0]}\n{completions[-1]}\n")
    infill = None
    if isinstance(tok, FIMTokenizer):
        prefix, suffix = INFILL
        ends = end_ids(tok)
        new = generate(model, infill_prompt(tok, prefix, suffix), 32, temperature=0.0, eot=tok.eot)[0]
        middle = tok.decode(new[: next((i for i, t in enumerate(new) if t in ends), len(new))])
        infill = {"prefix": prefix, "middle": middle, "suffix": suffix}
        print(f"=== infilling (greedy): the model writes what goes between ===\n{prefix}[{middle}]{suffix}")

    plot = plot_runs([out_dir]).path
    summary = {
        "before": before,
        "after": after,
        "steps": result.steps,
        "tokens": result.tokens,
        "seconds": round(result.seconds, 1),
        "params": model.num_params(),
        "checkpoint": str(checkpoint),
        "plot": str(plot),
        "completions": completions,
        "infill": infill,
    }
    write_json(out_dir / "summary.json", summary)
    print(f"wrote {checkpoint}, {out_dir / 'metrics.jsonl'}, {plot}, {out_dir / 'summary.json'}")
    print("\n=== what next ===\n" + "\n".join(next_commands(out_dir, data_dir)))
    return summary


@contextlib.contextmanager
def training_in(out_dir: Path) -> Iterator[Path]:
    """Lock `out_dir` and yield the folder to train in (`replacing_dir`'s). A run that fails before writing a file
    (a --set that train refuses) leaves none of the folders made for it, nor its lock file."""
    made = [p for p in (out_dir, *out_dir.parents) if not (p.exists() or p.is_symlink())]  # innermost first
    lock_was_there = (out_dir / LOCK).exists()
    with locked(out_dir, "demo"):
        in_place = is_empty_dir(out_dir)  # else the run is built in a temp folder that replaces it once complete
        try:
            with replacing_dir(out_dir) as run_dir:
                yield run_dir
        except BaseException:
            # With the lock still held: no other demo has started in what is removed.
            if not in_place and is_empty_dir(temp_dir_path(out_dir)):
                shutil.rmtree(temp_dir_path(out_dir), ignore_errors=True)
            if not lock_was_there and (not in_place or is_empty_dir(out_dir)):
                (out_dir / LOCK).unlink(missing_ok=True)
            for folder in made:  # a folder that holds a failed attempt's files is not empty, and stays
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise


def wrap_up(result: TrainResult, run_dir: Path, data_dir: Path) -> str:
    """What a finished `gptforge train` leaves beside its checkpoints, as the demo does: loss.png and summary.json,
    and the commands that go on from it."""
    plot = plot_runs([run_dir]).path
    checkpoint = run_dir / result.checkpoint.relative_to(result.run_dir)
    summary = {"before": result.first_val, "after": result.last_val, "steps": result.steps, "tokens": result.tokens}
    summary.update(seconds=round(result.seconds, 1), checkpoint=str(checkpoint), plot=str(plot))
    write_json(run_dir / "summary.json", summary)
    lines = [f"wrote {plot}, {run_dir / 'summary.json'}", "", "=== what next ===", *next_commands(run_dir, data_dir)]
    return "\n".join(lines)


def next_commands(out_dir: Path, data_dir: Path) -> list[str]:
    """The commands that go on from a demo's run folder: sample, eval, serve and export it."""
    run, data = shlex.quote(str(out_dir)), shlex.quote(str(data_dir))
    return [
        f"gptforge sample {run} --prompt 'def quicksort(xs):'     # more completions",
        f"gptforge eval {run} --data {data}     # the validation loss again (the same tokens)",
        f"gptforge serve {run}     # an OpenAI-compatible API and a page with the curves (the .[serve] extra)",
        f"gptforge export {run} --out {shlex.quote(str(out_dir / 'hf'))}     # a transformers folder",
    ]


CHAT_PRESET = "chat-cpu"
RL_PRESET = "rl-cpu"
HELD_OUT_TASKS = 70  # built-in held-out tasks scored at each stage of the chat demo: 10 of each family
TRAINING_TASKS = 4000  # built-in training tasks among its conversations (prepare keeps one of each repeat)
DRILL_TASKS = 4000  # and training-only drills, where the answer is a value of the request copied into code
STAGES = {"base": "the base model (each request as comments)", "sft": "after fine-tuning", "rl": "after RL"}


def run_chat_demo(
    base: str,
    data: str,
    out: str,
    time_budget: float | None,
    overrides: list[str],
    force: bool,
    rl_budget: float | None = None,
) -> dict:
    """Fine-tune the demo's model (`base`, trained first when it has no checkpoint) on conversations: requests for
    the training split's documented functions and built-in tasks; then RL from unit tests into OUT-rl (for
    `rl_budget` seconds, the preset's when None, none when 0). Held-out tasks' pass@1 and two replies are printed
    before and after each stage. `--set rl.*` reaches the RL stage, train.seed both, every other key the fine-tuning."""
    base_dir, data_dir, out_dir = output_folder(base, "--base"), output_folder(data, "--data"), Path(out)
    rl_dir = named(out_dir).with_name(f"{named(out_dir).name}-rl")
    chat_data = named(data_dir).with_name(f"{named(data_dir).name}-chat")
    check_output_dir(out_dir, force, reads=[data_dir, chat_data, base_dir], is_run=True)
    if rl_budget != 0:
        check_output_dir(rl_dir, force, reads=[data_dir, chat_data, base_dir, out_dir], is_run=True)
    sft_overrides = [o for o in overrides if not o.startswith("rl.")]
    _check_base_shape(base_dir, sft_overrides)
    base_checkpoint = _base_checkpoint(base_dir, data_dir)
    if not (data_dir / TOKENIZER_FILE).is_file():
        raise GptforgeError(
            f"--data {data_dir}: no {TOKENIZER_FILE}; the demo's data (prepared with its own BPE) is what --base reads"
        )
    budget = [] if time_budget is None else [f"train.time_budget={time_budget}"]
    start = [f"data.path={chat_data}", f"train.init_from={base_checkpoint}"]
    cfg = load_config(CHAT_PRESET, [*sft_overrides, *budget, *start])
    # The seed is the run's, both stages'; every other key but rl.* is the fine-tuning's.
    rl_settings = [o for o in overrides if o.startswith(("rl.", "train.seed="))]
    rl_settings += [] if rl_budget is None else [f"train.time_budget={rl_budget}"]
    rl_tasks = load_config(RL_PRESET, rl_settings).rl.tasks  # a bad rl.* value is said before any training
    if rl_budget != 0 and rl_tasks != BUILTIN:
        load_tasks(rl_tasks, flag="rl.tasks", split="train")
    with training_in(out_dir) as run_dir:  # locked first: a demo running there is said before the conversations
        stages = {"base": held_out_tasks(base_checkpoint, "base")}
        prepare_function_conversations(data_dir, chat_data)
        result = train(cfg, run_dir)
    checkpoint = out_dir / result.checkpoint.relative_to(run_dir)
    print(f"replies' validation loss: {result.first_val['loss']:.4f} before, {result.last_val['loss']:.4f} after")
    stages["sft"] = held_out_tasks(checkpoint, "sft")
    final, final_dir = checkpoint, out_dir
    if rl_budget != 0:
        rl_cfg = load_config(RL_PRESET, [*rl_settings, f"train.init_from={checkpoint}"])
        with training_in(rl_dir) as run_dir:
            rl_result = train_rl(rl_cfg, run_dir)
        final, final_dir = rl_dir / rl_result.checkpoint.relative_to(run_dir), rl_dir
        stages["rl"] = held_out_tasks(final, "rl")
        print(f"wrote {plot_rl(rl_dir).path}: reward, pass rate, reply length and time a step against steps")
    print(f"\n=== held-out tasks ({HELD_OUT_TASKS}, greedy): pass@1 ===")
    for stage, row in stages.items():
        print(f"{STAGES[stage]:>45}  {row['pass@1']:.4f}")
    summary = {"base": str(base_checkpoint), "checkpoint": str(checkpoint), "steps": result.steps}
    summary.update(before=result.first_val, after=result.last_val, stages=stages)
    summary.update(rl_checkpoint=str(final) if rl_budget != 0 else None)
    write_json(out_dir / "summary.json", summary)
    print(f"wrote {final}; talk with it: gptforge chat {shlex.quote(str(final_dir))}")
    return summary


def held_out_tasks(checkpoint: Path, stage: str) -> dict:
    """Greedy pass@1 on the held-out built-in tasks, with the replies to the first two; printed."""
    run = load_for_inference(checkpoint)
    result = evaluate_tasks(
        run.model, run.tokenizer, builtin_tasks("val", HELD_OUT_TASKS), n=1, ks=[1], temperature=0.0, dtype=run.dtype
    )
    row = result["families"]["all"]
    print(f"\n=== {STAGES[stage]}: held-out tasks pass@1 {row['pass@1']:.4f}, parses {row['parses']:.2f}, "
          f"defines {row['defines']:.2f} ===")  # fmt: skip
    for example in result["examples"]:
        print(f"user> {example['request']}\nassistant> {example['reply']}\n")
    return {**row, "replies": result["examples"]}


def _check_base_shape(base_dir: Path, overrides: list[str]) -> None:
    """`--set model.KEY` that the base's architecture would replace is refused as `train` refuses it, before a base
    is trained: the base the demo would train first has the demo's preset's shape."""
    if not model_overrides(overrides):
        return
    try:
        saved = config_from_dict(read_meta(resolve_checkpoint(base_dir))["config"]).model
    except GptforgeError:  # no base yet
        saved = load_config(PRESET).model
    check_model_overrides(load_config(CHAT_PRESET, overrides).model, saved, overrides, f"--base {base_dir}")


def _base_checkpoint(base_dir: Path, data_dir: Path) -> Path:
    """--base: a checkpoint folder, a run (its newest intact checkpoint), or a new folder the demo's model is
    trained into first."""
    if not (base_dir / META).exists() and latest_checkpoint(base_dir) is None:
        if not is_empty_dir(base_dir):  # a file, or a folder of the user's: never trained over
            raise GptforgeError(
                f"--base {base_dir}: not a gptforge run or checkpoint (no checkpoints/ or {META}); name one, or a new "
                "folder to train the demo's model into"
            )
        check_output_dir(base_dir, force=False, flag="--base", is_run=True)
        print(f"no trained model in {base_dir}: training the demo's first", flush=True)
        run_demo(str(base_dir), str(data_dir), None, [])
    return resolve_checkpoint(base_dir)


def prepare_function_conversations(data_dir: Path, chat_data: Path) -> Path:
    """`data/stdlib-chat.jsonl` (a request for each documented function of the stdlib, answered with its source,
    in its file's split; and the built-in tasks and drills, answered with their reference solutions) and the chat
    folder prepared from it; both reused when present, the rows written again where an earlier version of the demo
    wrote them without the drills, the folder prepared again once it no longer matches the rows or --data's BPE."""
    rows_file = chat_data.with_name(f"{chat_data.name}.jsonl")
    prepared = (chat_data / MANIFEST).is_file()
    if prepared:
        _check_ours(chat_data, rows_file)
    older = rows_file.is_file() and not any(
        isinstance(row, dict) and str(row.get("source", "")).startswith(DRILL_SOURCE)
        for _, row in read_jsonl(rows_file)
    )
    if not rows_file.is_file() or older:
        rows = itertools.chain(
            conversation_rows(stdlib_documents(), VAL_FRACTION),
            task_rows(TRAINING_TASKS, HELD_OUT_TASKS, DRILL_TASKS),
        )
        atomic_write(rows_file, "".join(to_json(row) + "\n" for row in rows))
    if not prepared or _stale(chat_data, data_dir, rows_file):
        # exact copies only: tasks a number or a separator apart are near copies in words, and distinct answers
        settings = ChatSettings(
            tokenizer=str(data_dir / TOKENIZER_FILE), val_fraction=0.0, dedup=DedupSettings("exact")
        )
        prepare_chat(str(rows_file.resolve()), chat_data, settings, force=prepared)  # from any folder later
    return rows_file


def _check_ours(chat_data: Path, rows_file: Path) -> None:
    """A chat folder prepared from another file than the demo's rows beside it is the user's: refused, never
    replaced (a file of the same name elsewhere included)."""
    source = Path(str(read_manifest(chat_data).get("source", "")))
    if source.resolve() != rows_file.resolve():
        raise GptforgeError(
            f"{chat_data}: conversations not from {rows_file}; move it away (the chat demo prepares its "
            "conversations there)"
        )


def _stale(chat_data: Path, data_dir: Path, rows_file: Path) -> bool:
    """The demo's chat folder no longer matches: other rows than the rows file's (written again since, an upgrade
    cut short included), other de-duplication, or another BPE than --data's (whose ids would mean other text)."""
    settings = read_manifest(chat_data).get("settings")
    settings = settings if isinstance(settings, dict) else {}
    if settings.get("sha256") != sources_sha256([rows_file]) or settings.get("dedup") != "exact":
        print(f"{chat_data}: prepared from other rows than {rows_file.name}'s; preparing it again", flush=True)
        return True
    try:
        same = (chat_data / TOKENIZER_FILE).read_bytes() == (data_dir / TOKENIZER_FILE).read_bytes()
    except OSError:  # no tokenizer.json: a folder of GPT-2 ids, which the demo's BPE does not read
        same = False
    if not same:
        print(f"{chat_data}: prepared with another tokenizer than --data's; preparing it again", flush=True)
    return not same
