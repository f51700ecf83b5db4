"""gptforge: pretrain GPT-2-class language models from scratch, end to end."""

__version__ = "0.1.0"
