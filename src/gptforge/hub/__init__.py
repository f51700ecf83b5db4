"""Hugging Face interop: GPT-2 key map, export and import, and git publishing of exported models."""
