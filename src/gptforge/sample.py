"""`gptforge sample`: continuations of prompts from a checkpoint, as printable text while the tokens arrive."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from gptforge.checkpoint import Inference, load_for_inference
from gptforge.data.fim import FIMTokenizer, end_ids, infill_prompt
from gptforge.errors import GptforgeError
from gptforge.model.generate import stream
from gptforge.runtime.device import autocast

# How an infilled middle stands out on a terminal: reverse video, an attribute rather than characters, so what is
# copied from the screen is the code itself. Piped output stays the plain text.
REVERSE, NORMAL = "\x1b[7m", "\x1b[27m"


def sample_texts(
    checkpoint: str,
    prompts: list[str],
    num_samples: int = 1,
    max_new_tokens: int = 128,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 0,
    device: str = "auto",
    use_cache: bool = True,
    dtype: str = "auto",
    suffix: str | None = None,
) -> Iterator[str]:
    """Load the checkpoint (a bad one fails here), then yield text to print as it is generated: a
    `--- sample N` line, the prompt, its continuation (with `suffix`: the middle, in reverse video on a terminal,
    then the suffix) and a newline, for each sample of each prompt."""
    run = load_for_inference(checkpoint, device, dtype)
    if suffix is not None and not isinstance(run.tokenizer, FIMTokenizer):
        raise GptforgeError(
            f"--suffix: {checkpoint} was trained without fill-in-the-middle (data.fim_rate=0), so it cannot infill; "
            "train with --set data.fim_rate=0.5"
        )
    g = torch.Generator(device=run.device).manual_seed(seed)
    settings = (max_new_tokens, 1, temperature, top_k, top_p, run.tokenizer.eot, g, use_cache)
    return _pieces(run, prompts, num_samples, settings, suffix)


def _pieces(run: Inference, prompts: list[str], num_samples: int, settings: tuple, suffix: str | None) -> Iterator[str]:
    tok, index = run.tokenizer, 0
    ends = end_ids(tok)
    for prompt in prompts:
        # An empty prompt starts a fresh document, as training documents start after EOT.
        ids = infill_prompt(tok, prompt, suffix) if suffix is not None else tok.encode(prompt) or [tok.eot]
        if suffix is not None and len(ids) > run.model.config.block_size:  # past it the sentinels would slide out
            raise GptforgeError(
                f"--prompt/--suffix: the infill prompt has {len(ids):,} tokens, the model's context "
                f"{run.model.config.block_size:,}; shorten the prefix or the suffix"
            )
        steps = settings
        if suffix is not None:  # the middle ends where the context does, its sentinels still in the window
            steps = (min(settings[0], run.model.config.block_size - len(ids) + 1), *settings[1:])
        mark = _reverse if suffix is not None and sys.stdout.isatty() else str
        for _ in range(num_samples):
            yield f"--- sample {index}\n{prompt}"
            new: list[int] = []
            shown = ""
            tokens = stream(run.model, ids, *steps)
            while True:
                with autocast(run.device, run.dtype):  # around the model only, not around our caller's code
                    nxt = next(tokens, None)
                if nxt is None or int(nxt) in ends:  # an infilled middle ends where the document would
                    break
                new.append(int(nxt))
                text = tok.decode(new)
                if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    yield mark(text[len(shown) :])
                    shown = text
            yield mark(tok.decode(new)[len(shown) :]) + (suffix or "") + "\n"
            index += 1


def _reverse(text: str) -> str:
    """`text` in reverse video, each piece on its own, so an error mid-sample leaves the terminal as it was."""
    return f"{REVERSE}{text}{NORMAL}" if text else ""
