"""GPT-2 with a fused cross-entropy and KV-cache generation; no I/O, optimizer or distributed code."""

from gptforge.model.gpt import GPT, MODEL_PRESETS, GPTConfig
from gptforge.model.kv_cache import KVCache, RowCache

__all__ = ["GPT", "GPTConfig", "KVCache", "MODEL_PRESETS", "RowCache"]
