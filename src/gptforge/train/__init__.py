"""Training: the loop (`trainer.py`) and the named pieces it calls."""
