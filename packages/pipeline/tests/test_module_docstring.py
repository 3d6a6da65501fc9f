"""The example at the top of `module.py` runs as written (its `TiedLayerSpec` calls used to pass
the tie key as the layer class and raise), and the stages it builds hold the tied embedding at
both ends."""

import re

import torch
import torch.nn.functional as F
from pipeline_testlib import Block, lm_head
from torch import nn

import minispeed.pipeline as pipeline
from minispeed.core.testing import run_distributed
from minispeed.pipeline import LayerSpec, TiedLayerSpec, module


def _example() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", module.__doc__, re.S)
    return code


def _run_example(rank, world_size):
    names = {"nn": nn, "F": F, "pipeline": pipeline, "LayerSpec": LayerSpec,
             "TiedLayerSpec": TiedLayerSpec, "Block": Block, "lm_head": lm_head,
             "vocab": 16, "d": 8}  # fmt: skip
    exec(_example(), names)
    built = names["module"]
    x = torch.randint(0, 16, (2, 4))
    out = built.forward_chunk(0, x if rank == 0 else torch.zeros(2, 4, 8))
    return {"tied": sorted(built.tied), "blocks": sum(len(c.layers) for c in built.chunks),
            "out": tuple(out.shape)}  # fmt: skip


def test_the_module_docstring_example_runs():
    results = run_distributed(_run_example, world_size=2, timeout_s=60)
    assert [r["tied"] for r in results] == [["embed"], ["embed"]]
    assert [r["blocks"] for r in results] == [4, 4]
    assert results[0]["out"] == (2, 4, 8) and results[1]["out"] == (2, 4, 16)
