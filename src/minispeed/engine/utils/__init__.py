"""DeepSpeed's `deepspeed.utils` import path; only `zero_to_fp32` lives here (a package named
for the path scripts import, not a grab bag)."""
