"""Hugging Face interop: GPT-2 key map, export and import, and git publishing of exported models."""

EXPORT_FORMATS = ("hf", "gguf", "peft")
"""`gptforge export --format`: a transformers folder, one GGUF file for llama.cpp and Ollama, or a LoRA run's
adapters as a PEFT folder (with its base model inside)."""
GGUF_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
"""`--gguf-type` -> gguf.LlamaFileType: how the 2-D weights are stored (norms and biases stay f32, as llama.cpp's
converter keeps them)."""
