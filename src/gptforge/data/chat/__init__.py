"""Conversations: the chat template, `prepare --chat`, and instruction data built offline."""
