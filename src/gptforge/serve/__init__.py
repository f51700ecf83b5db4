"""`gptforge serve`: an OpenAI-compatible completions API and a web page that watches runs (optional extra)."""
