"""Verifiable code tasks: a request in natural language naming a Python function, and the hidden unit tests its
code must pass. Built in (`builtin.py`, seeded families) or read from a JSONL file (`read_tasks`)."""
