"""Reading runs back: metrics.jsonl per kind, plots and markdown summaries."""
