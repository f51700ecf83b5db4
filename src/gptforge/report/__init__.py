"""Reports on runs, finished or running: `plot.py` (PNG of the curves) and `summary.py` (markdown)."""
