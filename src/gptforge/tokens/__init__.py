"""How a model's text becomes ids and back: the base tokenizer (GPT-2's or a trained BPE), fill-in-the-middle's
sentinels and the chat template, below the data pipeline and the model alike."""
