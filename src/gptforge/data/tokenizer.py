"""The tokenizer a prepared data folder was made with, and the check that a model reads its ids as the same text."""

from __future__ import annotations

from pathlib import Path

from gptforge.data.shards import read_manifest
from gptforge.errors import GptforgeError
from gptforge.tokens.tokenizer import Tokenizer, load_tokenizer, same_tokenizer


def data_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared folder was made with."""
    return load_tokenizer(read_manifest(data_dir)["tokenizer"]["name"], data_dir)


def check_data_tokenizer(data_tok: Tokenizer, data_dir: str | Path, model_tok: Tokenizer, model: str) -> None:
    """Refuse data whose ids mean other text to `model` (a checkpoint): its loss would be meaningless."""
    if same_tokenizer(data_tok, model_tok):
        return
    data_says, model_says = (f"{t.name} ({getattr(t, 'base', t).vocab_size:,} tokens)" for t in (data_tok, model_tok))
    raise GptforgeError(
        f"{data_dir}: made with tokenizer {data_says}, but {model} uses "
        f"{'another ' if data_says == model_says else ''}{model_says}; "
        f"prepare the data with --tokenizer {model_tok.path or model_tok.name}"
    )
