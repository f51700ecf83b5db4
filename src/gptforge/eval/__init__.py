"""Evaluations: loss / perplexity / bits per byte, HellaSwag, HumanEval, and `gptforge eval` over a checkpoint."""
