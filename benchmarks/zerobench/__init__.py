"""`zero_vs_torch.py` split by concern: contenders, timing rounds, heap peaks, report, and the
worker processes (`ranks`, shared with the other ZeRO benchmarks)."""
