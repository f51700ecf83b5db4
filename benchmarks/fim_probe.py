"""Does a FIM-trained checkpoint use the suffix? Two probes on a prepared folder's held-out code:

1. the bits a middle costs given prefix and suffix (PSM, as training rearranges it) against the prefix alone, per
   character of the middle and over its first five tokens (where the prefix's end lies behind the whole suffix);
2. single-line exact match with the suffix in StarCoder's SPM order (the middle continues the prefix, so its tokens
   are the left-to-right ones) against the prefix alone with the same context.

    python benchmarks/fim_probe.py RUN_OR_CHECKPOINT --data DATA_DIR [--middles 95] [--lines 1000] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from gptforge.checkpoint import load_for_inference
from gptforge.errors import GptforgeError
from gptforge.eval import code

FIRST = 5  # tokens at the start of a middle


def middle_bits(model, tok, documents: list[str], cases: int) -> dict[str, float]:
    """Bits of random middles (200-token stretches cut at two random characters) with and without the suffix."""
    rng, S = np.random.default_rng(0), tok.sentinels
    span = min(200, model.config.block_size - 16)  # tokens of text a case cuts; a middle and its prompt fit the context
    total = {"prefix_only": 0.0, "with_suffix": 0.0, "prefix_only_first": 0.0, "with_suffix_first": 0.0}
    chars = n = 0

    def nats(ids: list[int], start: int) -> tuple[float, float]:
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids[:-1]]), all_logits=True)
        nll = -torch.log_softmax(logits.float()[0], -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        return nll[start - 1 :].sum().item(), nll[start - 1 : start - 1 + FIRST].sum().item()

    for doc in documents:
        ids = tok.encode(doc)
        while n < cases and len(ids) >= span + 60 and rng.random() < 0.75:
            s = int(rng.integers(0, len(ids) - span - 50))
            text = tok.decode(ids[s : s + span])
            i, j = sorted(int(c) for c in rng.integers(0, len(text), 2))
            if j - i < 5:
                continue
            p, m, x = (tok.encode(t) for t in (text[:i], text[i:j], text[j:]))
            fim = [S.prefix, *p, S.suffix, *x, S.middle, *m]
            if len(fim) > model.config.block_size:  # cut apart, the pieces took more tokens than the context
                continue
            alone = nats((p or [tok.eot]) + m, max(1, len(p)))
            both = nats(fim, len(fim) - len(m))
            for key, (whole, first) in (("prefix_only", alone), ("with_suffix", both)):
                total[key] += whole
                total[f"{key}_first"] += first
            chars, n = chars + j - i, n + 1
    if not n:
        raise SystemExit("fim_probe.py: error: no held-out document is long enough to cut a middle from")
    per_char = {k: v / chars / math.log(2) for k, v in total.items() if not k.endswith("_first")}
    first = {k: v / n / math.log(2) for k, v in total.items() if k.endswith("_first")}
    out = {"middles": n, **{f"{k}_bits_per_char": v for k, v in per_char.items()}}
    return out | {f"{k}_bits": v for k, v in first.items()}


def spm_lines(model, tok, documents: list[str], lines: int, device, dtype) -> dict[str, float]:
    """Exact single lines with SPM prompts against the prefix alone, both with the same prefix tokens."""
    cases, S = code.hidden_spans(documents, lines, 0), tok.sentinels
    middles, targets = {"spm": [], "prefix_only": []}, []
    for case in cases:
        room = model.config.block_size - code._middle_tokens(model, 1) - 3
        p, s = code._fit(tok, case.prefix, case.suffix, room)
        targets.append(code._trimmed(case.middle, 1))
        middles["spm"].append(code._middle(model, [S.prefix, S.suffix, *s, S.middle, *p], newline=True, count=1))
        middles["prefix_only"].append(code._middle(model, p or [tok.eot], newline=True, count=1))
    out = {"lines": len(cases)}
    for key, ms in middles.items():
        out[f"{key}_exact"] = code._hits(code._written(model, tok, ms, device, dtype), targets) / max(1, len(cases))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data", required=True)
    parser.add_argument("--middles", type=int, default=95)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        run = load_for_inference(args.checkpoint, device="cpu", dtype="float32")
    except GptforgeError as e:
        raise SystemExit(f"fim_probe.py: error: {e}") from None
    if not hasattr(run.tokenizer, "sentinels"):
        raise SystemExit(f"{args.checkpoint}: trained without FIM (data.fim_rate = 0)")
    documents = code.held_out_documents(args.data, run.tokenizer, max_documents=10**6)
    result = {
        "checkpoint": args.checkpoint,
        **middle_bits(run.model, run.tokenizer, documents, args.middles),
        **spm_lines(run.model, run.tokenizer, documents, args.lines, run.device, run.dtype),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
