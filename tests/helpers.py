"""Helpers shared by test modules: reading a run's losses and weights, running the CLI in a subprocess, a lock
held by another process, a randomized tiny model, a read of a FIFO that cannot hang the suite."""

import contextlib
import json
import os
import subprocess
import sys
import threading

import torch

from gptforge.checkpoint import load_checkpoint


def losses(run_dir, kind="train"):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == kind}


def cli(*args):
    return [sys.executable, "-m", "gptforge", *map(str, args)]


def read_fifo(read, fifo, seconds: float = 10.0):
    """What `read(fifo)` returned or raised, run in a thread: a read that blocks on the FIFO is released by a writer
    closing it, and the test fails instead of hanging the suite."""
    outcome = []

    def run():
        try:
            outcome.append(read(fifo))
        except Exception as e:  # noqa: BLE001 - the caller checks what was raised
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # end of file for the reader that waits on it
        thread.join(seconds)
        raise AssertionError(f"reading {fifo} blocked for {seconds:g}s")
    return outcome[0]


def randomize(model, matrix_std=None):
    """Random norm gains and biases (so a swapped one shows in logits) and, with `matrix_std`, random matrices of
    that spread; returns the model in eval mode. Drawn in row-major order whatever a weight's layout (inference
    stores them column-major on CPU), so a seed gives the same model either way."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.empty(p.shape).normal_(0, 0.1))
            elif p.dim() == 1:
                p.copy_(torch.empty(p.shape).normal_(1, 0.1))
            elif matrix_std is not None:
                p.copy_(torch.empty(p.shape).normal_(0, matrix_std))
    return model.eval()


def weights(ckpt):
    return load_checkpoint(ckpt)[0].state_dict()


@contextlib.contextmanager
def lock_held_elsewhere(folder, what="train"):
    """Another process holding `locked(folder)` for the block; yields its pid and SIGKILLs it at the end."""
    program = (
        f"from gptforge.outputs import locked\nwith locked({str(folder)!r}, {what!r}):\n"
        "    print('held', flush=True)\n    input()"
    )
    holder = subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait(timeout=30)


def chat_checkpoint(path, chat: bool = True, ends_every_reply: bool = False, block_size: int = 48):
    """A tiny GPT-2-block checkpoint with the gpt2 tokenizer (and the chat template's tokens when `chat`); with
    `ends_every_reply`, weights that put `<|im_end|>` first at every position: each reply ends at once, by that
    token alone (a stop that is missed shows as `<|im_end|>` text)."""
    import dataclasses

    from gptforge.checkpoint import write_checkpoint
    from gptforge.config import load_config
    from gptforge.model.gpt import GPT
    from gptforge.tokens.chat import with_chat
    from gptforge.tokens.tokenizer import load_tokenizer

    cfg = load_config("tiny")
    base = load_tokenizer("gpt2")
    tok = with_chat(base) if chat else base
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size, block_size=block_size)
    cfg = dataclasses.replace(cfg, model=model_cfg, data=dataclasses.replace(cfg.data, chat_template="chatml" * chat))
    torch.manual_seed(0)
    model = GPT(model_cfg)
    if ends_every_reply:
        with torch.no_grad():  # ln_f's output is its bias whatever the input; the tied head then scores im_end most
            direction = torch.nn.functional.normalize(torch.randn(model_cfg.n_embd), dim=0)
            model.transformer.ln_f.weight.zero_()
            model.transformer.ln_f.bias.copy_(10 * direction)
            model.transformer.wte.weight[tok.im_end] = 10 * direction
    write_checkpoint(path, model, None, cfg, base, {"step": 1})
    return path
