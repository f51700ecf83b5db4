"""A trained checkpoint in llama.cpp: bits per byte of each GGUF type on held-out text against ours, and how often
llama.cpp's greedy text equals `gptforge sample --temperature 0`.

    python benchmarks/llamacpp.py RUN_OR_CKPT --data DATA_DIR [--windows 8] [--prompts 8] [--json OUT.json]

Held-out text is the data folder's validation split, cut into windows of the model's context; each type's file is
written to a temporary folder and read with llama-cpp-python (f32 KV cache, one thread)."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from gptforge.checkpoint import load_checkpoint
from gptforge.data.shards import read_manifest, read_shard
from gptforge.hub import GGUF_FILE_TYPES
from gptforge.hub.gguf_export import write_gguf
from gptforge.model.generate import generate


def windows(data_dir: Path, length: int, count: int, vocab: int) -> list[list[int]]:
    """`count` windows of `length` tokens spread evenly over the validation split."""
    manifest = read_manifest(data_dir)
    tokens = np.concatenate(
        [read_shard(data_dir / s["file"], vocab) for s in manifest["shards"] if s["split"] == "val"]
    )
    starts = np.linspace(0, len(tokens) - length - 1, count).astype(int)
    return [tokens[s : s + length].tolist() for s in starts]


def nll_bits(logits: np.ndarray, ids: list[int]) -> float:
    logp = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), dim=-1)
    return -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum().item() / math.log(2)


def llama_run(path: Path, texts: list[list[int]], prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=len(texts[0]) + new, logits_all=True, n_threads=1, verbose=False,
                          type_k=0, type_v=0)  # fmt: skip
    try:
        bits = 0.0
        for ids in texts:
            llm.reset()
            llm.eval(ids)
            bits += nll_bits(np.array(llm.scores[: len(ids)]), ids)
        outs = []
        for prompt in prompts:
            out = list(prompt)
            for _ in range(new):
                llm.reset()
                llm.eval(out)
                out.append(int(np.argmax(llm.scores[len(out) - 1])))
            outs.append(out[len(prompt) :])
        return bits, outs
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok, _, meta = load_checkpoint(args.checkpoint)
    length = model.config.block_size - args.new_tokens
    texts = windows(args.data, length, args.windows, model.config.vocab_size)
    n_bytes = sum(len(tok.decode(ids[1:]).encode()) for ids in texts)
    prompts = [ids[:16] for ids in texts[: args.prompts]]
    with torch.no_grad():
        ours_bits = sum(
            nll_bits(model(torch.tensor([ids]), all_logits=True)[0][0, :, : model.config.vocab_size], ids)
            for ids in texts
        )
    ours_greedy = [generate(model, p, args.new_tokens, temperature=0.0)[0] for p in prompts]
    result = {"checkpoint": str(args.checkpoint), "step": meta["step"], "bytes": n_bytes}
    result["ours_bpb"] = ours_bits / n_bytes
    with tempfile.TemporaryDirectory() as tmp:
        for gguf_type in GGUF_FILE_TYPES:
            path = write_gguf(model, tok, Path(tmp) / f"{gguf_type}.gguf", gguf_type, "bench")
            bits, greedy = llama_run(path, texts, prompts, args.new_tokens)
            same = sum(g[: len(o)] == o for g, o in zip(greedy, ours_greedy, strict=True))
            result[gguf_type] = {
                "MiB": round(path.stat().st_size / 2**20, 2),
                "bpb": bits / n_bytes,
                "greedy_equal": f"{same}/{len(prompts)}",
            }
            print(gguf_type, result[gguf_type], flush=True)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
