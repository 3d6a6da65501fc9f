"""`zero_vs_torch.py` split by concern: contenders, timing rounds, heap peaks, report."""
