"""The side-by-side table of `benchmarks/gpu.sh peers`: tokens/s of gptforge, llm.c and build-nanogpt from the
files each round left in OUT, every program's runs and its ratio to gptforge's median (524,288-token steps).

    python benchmarks/peers_table.py OUT [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

STEP_TOKENS = 524_288
LLMC_STEP = re.compile(r"^step\s+(\d+)/\d+ \|.*\| ([\d.]+) ms \|", re.M)


def llmc_tokens_per_s(log: str) -> float:
    """llm.c's median step time over steps 2.. (its first steps pay cuBLAS and cuDNN's planning)."""
    ms = [float(t) for step, t in LLMC_STEP.findall(log) if int(step) >= 2]
    if not ms:
        raise SystemExit("llm.c printed no timed step (see its log)")
    return STEP_TOKENS / (statistics.median(ms) / 1000)


def runs(out: Path) -> dict[str, list[dict]]:
    """Each program's rounds: tokens/s and peak memory where the program reports it."""
    found: dict[str, list[dict]] = {"gptforge": [], "llm.c": [], "build-nanogpt": []}
    for path in sorted(out.glob("bench-peers-*.json")):
        r = json.loads(path.read_text())
        found["gptforge"].append(
            {"tokens_per_s": r["ours"]["tokens_per_s"], "peak_gb": r["ours_peak_memory_mb"] / 1024}
        )
    for path in sorted(out.glob("llmc-*.log")):
        if path.name != "llmc-build.log":
            found["llm.c"].append({"tokens_per_s": llmc_tokens_per_s(path.read_text()), "peak_gb": None})
    for path in sorted(out.glob("nanogpt-*.json")):
        r = json.loads(path.read_text().strip().splitlines()[-1])
        found["build-nanogpt"].append({"tokens_per_s": r["tokens_per_s"], "peak_gb": r["peak_gb"]})
    return found


def table(found: dict[str, list[dict]]) -> str:
    ours = statistics.median(r["tokens_per_s"] for r in found["gptforge"]) if found["gptforge"] else None
    lines = [
        "| program | tokens/s, each run | median | gptforge against it | peak memory |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, rows in found.items():
        if not rows:
            lines.append(f"| {name} | did not run | | | |")
            continue
        median = statistics.median(r["tokens_per_s"] for r in rows)
        each = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in rows)
        ratio = f"{ours / median:.3f}×" if ours else ""
        peaks = [r["peak_gb"] for r in rows if r["peak_gb"] is not None]
        lines.append(f"| {name} | {each} | {median:,.0f} | {ratio} | {f'{max(peaks):.1f} GB' if peaks else ''} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    found = runs(args.out)
    print(table(found))
    if args.json:
        args.json.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
