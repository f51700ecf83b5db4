"""`gptforge report RUN_DIR`: a markdown summary of a run to paste into an issue or a paper."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

from gptforge.errors import GptforgeError
from gptforge.eval.code import SPAN_LINES
from gptforge.files import atomic_write
from gptforge.inputs import printable, read_text
from gptforge.rundir import CONFIG, finite, finite_number, format_duration, read_metrics, val_sources


def run_report(run_dir: str | Path) -> str:
    """Best val loss / perplexity / bpb (and each folder's of a mix), best HellaSwag, the last code measures, tokens,
    wall time, mean tokens/s and MFU, an RL run's reward and held-out pass@1, and the config; also written to
    RUN_DIR/report.md."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir, ("train", "val", "hellaswag", "code", "rl", "tasks"))
    train, val, hs = records["train"], finite(records["val"], "loss"), finite(records["hellaswag"], "acc_norm_token")
    lines = [f"# Run `{printable(run_dir.resolve().name)}`", "", "| metric | value |", "| --- | --- |"]
    if train:
        steady = train[1:] or train  # the first step pays for warm-up
        lines += [
            f"| steps | {train[-1]['step']:,} |",
            f"| tokens seen | {train[-1]['tokens']:,} |",
            f"| wall time (train records) | {format_duration(train[-1]['time'] - train[0]['time'])} |",
            f"| mean tokens/s | {_mean(steady, 'tokens_per_s'):,.0f} |",
            f"| mean MFU | {_percent(_mean(steady, 'mfu'))} |",
            f"| final train loss | {_mean(train[-1:], 'loss'):.4f} |",
            f"| skipped (non-finite) steps | {train[-1].get('skipped', 0)} |",
        ]
    if val:
        best = min(val, key=lambda r: r["loss"])
        lines += [
            f"| best val loss | {best['loss']:.4f} (step {best['step']:,}) |",
            f"| best val perplexity | {_number(best, 'ppl', digits=2)} |",
            f"| best val bits/byte | {_number(best, 'bpb')} |",
            f"| final val loss | {val[-1]['loss']:.4f} (step {val[-1]['step']:,}) |",
        ]
        lines += [  # a run on a mix: each folder's final numbers (its val loss above is their weighted mean)
            f"| final val loss / bits per byte: {name} | {_number(val[-1], f'loss/{name}')} / "
            f"{_number(val[-1], f'bpb/{name}')} |"
            for name in val_sources(val)
        ]
    if hs:
        best = max(hs, key=lambda r: r["acc_norm_token"])
        where = f"(step {best['step']:,}, {best['n']} examples)"
        lines.append(f"| best HellaSwag acc_norm_token | {best['acc_norm_token']:.4f} {where} |")
    if records["code"]:
        last = records["code"][-1]
        for key, what in (("", "one line"), ("span_", f"{SPAN_LINES} lines")):
            cases = last.get("spans" if key else "cases", 0)
            lines.append(
                f"| code infilling exact match, {what} (step {last['step']:,}, {cases} held-out cases) | "
                f"{_share(last, key + 'infill_exact')}; prefix only {_share(last, key + 'prefix_exact')} |"
            )
        parsed = f"{_share(last, 'parse_rate')} of {last['functions']}" if "functions" in last else "n/a"
        lines.append(f"| code: sampled function bodies that parse | {parsed} |")
    lines += _rl_lines(records["rl"], records["tasks"])
    config = run_dir / CONFIG
    if config.is_file():
        lines += ["", "## Config", "", "```toml", read_text(config).strip(), "```"]
    text = "\n".join(lines) + "\n"
    try:
        atomic_write(run_dir / "report.md", text)
    except GptforgeError as e:  # a read-only run folder still gets its report printed
        warnings.warn(f"report.md not written: {e}", stacklevel=2)
    return text


def _rl_lines(steps: list[dict], held_out: list[dict]) -> list[str]:
    """An RL run's rows: its steps, the last ten steps' reward and share solved, held-out pass@1 first and last."""
    lines = []
    if steps:
        last = steps[-10:]
        lines += [
            f"| RL steps | {steps[-1]['step']:,} |",
            f"| mean reward, share solved (last {len(last)} steps) | {_mean(last, 'reward'):.3f}, "
            f"{_mean(last, 'pass_rate'):.3f} |",
        ]
    if held_out:
        first, final = held_out[0], held_out[-1]
        lines.append(
            f"| held-out pass@1 ({final['tasks']} tasks) | {_share(first, 'pass@1')} at step {first['step']:,}, "
            f"{_share(final, 'pass@1')} at step {final['step']:,} |"
        )
    return lines


def _number(record: dict, key: str, digits: int = 4) -> str:
    """A finite number, or n/a: bits per byte is null where the data folder does not say its bytes (an llm.c
    folder without a manifest, held-out replies that are empty)."""
    value = record.get(key)
    return f"{value:.{digits}f}" if finite_number(value) else "n/a"


def _share(record: dict, key: str) -> str:
    value = record.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    return f"{value:.1%}" if ok else "n/a"


def _percent(value: float) -> str:
    """A share, or why there is none: MFU reads null where the device's peak was unknown or slowed by load."""
    return "n/a (no step had a trustworthy peak to compare with)" if math.isnan(value) else f"{value:.1%}"


def _mean(records: list[dict], key: str) -> float:
    """Mean of the finite values (nan when there are none: a diverged last step)."""
    values = [float(r[key]) for r in finite(records, key)]
    return sum(values) / len(values) if values else math.nan  # fmean's fsum raises past a float's range
