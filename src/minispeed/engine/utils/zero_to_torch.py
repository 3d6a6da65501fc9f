"""DeepSpeed's `deepspeed.utils.zero_to_torch`: the checkpoint converter whose `--dtype` is required.

```bash
python -m minispeed.engine.utils.zero_to_torch CKPT_DIR OUT_DIR --dtype bf16
```

`save_checkpoint` writes a `zero_to_torch.py` that runs this beside the tag folders, as DeepSpeed
does. The work is `zero_to_fp32.convert_zero_checkpoint_to_state_dict`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from minispeed.engine.utils import zero_to_fp32

__all__ = ["main"]


def main(args: Sequence[str] | None = None) -> int:
    """`CHECKPOINT_DIR OUTPUT_DIR --dtype {fp32,fp16,bf16,...}` and `zero_to_fp32.main`'s options."""
    return zero_to_fp32.main(args, dtype_required=True)


if __name__ == "__main__":
    raise SystemExit(main())
