"""plumbing: what train.py and evaluate.py need besides the method (a reader may skip it)."""
