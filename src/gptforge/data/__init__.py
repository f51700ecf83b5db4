"""Corpus -> token shards -> batches."""
