"""Decoding speed of one checkpoint: gptforge's engine against llama.cpp (the same weights as GGUF, f32 and q8_0)
and `transformers` (the same weights as an HF folder), interleaved round by round in one process.

    python benchmarks/decode.py RUN_OR_CKPT|- [--preset NAME] [--threads 2] [--new-tokens 128] [--rounds 3]
        [--batches 1,8,32] [--device cpu] [--dtype float32] [--ours float:rows,int8:compiled] [--serve int8:compiled]
        [--no-llama] [--no-hf] [--json OUT.json]

Per candidate: greedy decode tokens/s and ms a token at each batch (a prompt's prefill excluded), prefill tokens/s
and time to first token for a prompt of half the context. Each of --ours is the engine with those weights and that
decode step ("gptforge" for float:rows, else "gptforge WEIGHTS STEP"); each of --serve is `gptforge serve` with
those flags in a process of its own, a streamed request at a time (batch 1; a run folder or checkpoint only).
llama.cpp runs batch 1 only (its Python binding decodes one sequence). The host's matmul peaks are recorded
beside the figures."""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from gptforge.checkpoint import load_checkpoint
from gptforge.config import load_config
from gptforge.model.engine import Decoding, Engine, Sequence, column_major
from gptforge.model.gpt import GPT
from gptforge.model.quantize import quantize_int8
from gptforge.runtime.device import resolve_device
from gptforge.runtime.threads import sustained_matmul_flops
from gptforge.tokens.tokenizer import load_tokenizer

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


class Ours:
    """gptforge's engine: the rows of a batch decode together, each from its own copy of the prompt."""

    def __init__(self, model, dtype: torch.dtype, decoding: Decoding) -> None:
        self.model, self.dtype, self.decode_mode = model, dtype, decoding.step
        self.name = "gptforge" if decoding == Decoding() else f"gptforge {decoding.weights} {decoding.step}"

    def decode(self, prompt: list[int], new: int, batch: int) -> tuple[float, float]:
        """(seconds to the first token of every row, seconds for the rest)."""
        engine = Engine(self.model, rows=batch, dtype=self.dtype, decode=self.decode_mode)
        seqs = [Sequence(list(prompt), new) for _ in range(batch)]
        engine.submit(*seqs)
        start = time.perf_counter()
        engine.step()
        first = time.perf_counter()
        while engine.busy:
            engine.step()
        _sync(self.model)
        return first - start, time.perf_counter() - first


class Served:
    """`gptforge serve` in a process of its own: one streamed greedy request at a time (batch 1)."""

    def __init__(self, path: str, decoding: Decoding, threads: int, dtype: str) -> None:
        from serve import start_server

        flags = ("--weights", decoding.weights, "--decode", decoding.step, "--threads", str(threads), "--dtype", dtype)
        self.server, self.url = start_server(path, 1, flags)
        self.name = f"serve {decoding.weights} {decoding.step}"
        self.model = json.load(urllib.request.urlopen(f"{self.url}/v1/models", timeout=60))["data"][0]["id"]

    def decode(self, prompt: list[int], new: int, batch: int) -> tuple[float, float]:
        """As Ours: the first token is the whole of a one-token request, the rest what the full request takes
        longer (a stream's first chunk may hold several tokens, so its arrival is not the first token's). Each
        follows a one-token request, so neither pays for waking a server idle while the others ran. A reply
        that ends early (the model's end of text) is timed over the tokens it has."""
        from serve import post

        body = {"model": self.model, "prompt": prompt, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        post(self.url, {**body, "max_tokens": 1})
        first, _, one, status = post(self.url, {**body, "max_tokens": 1})
        post(self.url, {**body, "max_tokens": 1})
        total, _, tokens, status_all = post(self.url, {**body, "max_tokens": new})
        if status != 200 or status_all != 200 or one != 1 or tokens < 2:
            raise SystemExit(f"{self.name}: HTTP {status}/{status_all}, {one}/{tokens} tokens")
        return first, (total - first) * (new - 1) / (tokens - 1)

    def close(self) -> None:
        self.server.terminate()
        self.server.wait(timeout=30)


class Llama:
    """llama.cpp through llama-cpp-python on a GGUF of the same weights, greedy, one sequence."""

    def __init__(self, path: Path, threads: int, n_ctx: int, kind: str) -> None:
        import llama_cpp

        self.name = f"llama.cpp {kind}"
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)

    def decode(self, prompt: list[int], new: int, batch: int) -> tuple[float, float]:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        token = int(self.llm.scores[self.llm.n_tokens - 1].argmax())
        first = time.perf_counter()
        for _ in range(new - 1):
            self.llm.eval([token])
            token = int(self.llm.scores[self.llm.n_tokens - 1].argmax())
        return first - start, time.perf_counter() - first


class Transformers:
    """`transformers`' generate on an HF export of the same weights, greedy, its default (dynamic) cache."""

    name = "transformers"

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
        self.device = device

    def decode(self, prompt: list[int], new: int, batch: int) -> tuple[float, float]:
        ids = torch.tensor([prompt] * batch, device=self.device)
        kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            start = time.perf_counter()
            self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            _sync(self.model)
            first = time.perf_counter() - start
            start = time.perf_counter()
            self.model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
            _sync(self.model)
        return first, time.perf_counter() - start - first


def _sync(model) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(candidates: list, cases: list[tuple[list[int], int, int]], rounds: int) -> dict[str, dict]:
    """Median seconds over `rounds`, the candidates taking turns case by case so a slow spell hits all alike."""
    times: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for prompt, new, batch in cases:
            for cand in candidates:
                if batch > 1 and isinstance(cand, Llama | Served):
                    continue
                times.setdefault((cand.name, len(prompt), batch), []).append(cand.decode(prompt, new, batch))
    out: dict[str, dict] = {}
    for (name, prompt_len, batch), runs in times.items():
        first = statistics.median(f for f, _ in runs)
        rest = statistics.median(r for _, r in runs)
        new = next(n for p, n, b in cases if len(p) == prompt_len and b == batch)
        out.setdefault(name, {})[f"prompt {prompt_len}, batch {batch}"] = {
            "first_token_ms": round(1000 * first, 2),
            "prefill_tokens_per_s": round(batch * prompt_len / first, 1),
            "ms_per_step": round(1000 * rest / (new - 1), 3),
            "tokens_per_s": round(batch * (new - 1) / rest, 1),
        }
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a run or checkpoint; or --preset NAME for random weights of its shape")
    parser.add_argument("--preset", help="time a freshly initialised model of this preset (GPT-2 BPE) instead")
    parser.add_argument("--threads", type=_at_least(1), default=2)
    parser.add_argument("--new-tokens", type=_at_least(2), default=128, help="at most half the context (cut to it)")
    parser.add_argument("--rounds", type=_at_least(1), default=3)
    parser.add_argument("--batches", type=_sizes, default=[1, 8, 32], help="comma-separated, e.g. 1,8,32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--ours", type=_variants, default=[Decoding()], help="the engine's WEIGHTS:STEP variants")
    parser.add_argument("--serve", type=_variants, default=[], help="`gptforge serve`'s WEIGHTS:STEP variants")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.json is not None and (not args.json.parent.is_dir() or args.json.is_dir()):  # before the run, not after
        parser.error(f"--json {args.json}: a folder, or in a folder that does not exist")
    return args


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text}: must be at least {low}")
        return value

    return parse


def _sizes(text: str) -> list[int]:
    sizes = [_at_least(1)(part) for part in text.split(",")]
    if len(set(sizes)) < len(sizes):  # one result each: a repeat would overwrite the other
        raise argparse.ArgumentTypeError(f"{text!r}: a batch size twice")
    return sizes


def _variants(text: str) -> list[Decoding]:
    """'float:rows,int8:compiled' as Decodings: WEIGHTS:STEP, comma-separated, at least one."""
    parts = text.split(",")
    if not all(part.count(":") == 1 for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected WEIGHTS:STEP, comma-separated, e.g. int8:compiled")
    if len(set(parts)) < len(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: a variant twice")
    try:
        return [Decoding(*part.split(":")) for part in parts]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = resolve_device(args.device, "--device"), getattr(torch, args.dtype)
    if args.preset:  # speed does not depend on the weights: a GPU machine needs no trained checkpoint
        torch.manual_seed(0)
        model, tok, meta = GPT(load_config(args.preset).model).to(device).eval(), load_tokenizer("gpt2"), {"step": 0}
    else:
        model, tok, _, meta = load_checkpoint(args.checkpoint, device)
    block = model.config.block_size
    new = min(args.new_tokens, block // 2)
    short = tok.encode(PROMPT)
    long = (tok.encode(PROMPT * 64))[: block // 2]
    cases = [(short, new, b) for b in args.batches] + [(long, new, 1)]
    candidates: list = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_llama and device.type == "cpu":
            from gptforge.hub.gguf_export import write_gguf

            for kind in ("f32", "q8_0"):
                path = write_gguf(model, tok, Path(tmp) / f"{kind}.gguf", kind, "bench")
                candidates.append(Llama(path, args.threads, block, kind))
        if not args.no_hf:
            from gptforge.hub.convert import export_hf

            candidates.append(Transformers(export_hf(model, tok, Path(tmp) / "hf"), device, dtype))
        ours = []
        for decoding in args.ours:
            copied = quantize_int8(copy.deepcopy(model)) if decoding.weights == "int8" else copy.deepcopy(model)
            if device.type == "cpu":  # as `load_for_inference` lays them out for sample, chat and serve
                column_major(copied)
            ours.append(Ours(copied, dtype, decoding))
        served = [Served(str(args.checkpoint), d, args.threads, args.dtype) for d in args.serve]
        candidates = ours + served + candidates
        try:
            # Warm-up: first calls allocate and load kernels, and a compiled step compiles at each batch size.
            measure(candidates, [(short, 8, b) for b in sorted({b for _, _, b in cases})], 1)
            result = measure(candidates, cases, args.rounds)
        finally:
            for server in served:
                server.close()
    peaks = {
        name: round(sustained_matmul_flops(args.threads, d) / 1e9, 1)
        for name, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    report = {
        "variants": {
            key: ",".join(f"{d.weights}:{d.step}" for d in ds)
            for key, ds in (("ours", args.ours), ("serve", args.serve))
        },
        "checkpoint": args.preset or str(args.checkpoint),
        "step": meta["step"],
        "parameters": model.num_params(),
        "host": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "threads": args.threads,
        "device": str(device),
        "dtype": args.dtype,
        "matmul_gflops": peaks,
        "results": result,
    }
    ours = result[ours[0].name]
    for name, cases_done in result.items():
        for case, r in cases_done.items():
            ratio = ours[case]["tokens_per_s"] / r["tokens_per_s"] if case in ours else float("nan")
            print(f"{name:24} {case:22} {r['tokens_per_s']:10,.1f} tokens/s {r['ms_per_step']:8.3f} ms/step "
                  f"first token {r['first_token_ms']:8.2f} ms  (gptforge {ratio:.2f}x)")  # fmt: skip
    print(f"host matmul peaks on {args.threads} threads: {peaks['fp32']} GFLOP/s fp32, {peaks['bf16']} bf16")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
