"""init_inference on minispeed's GPT: fused blocks give the original's logits; the report is honest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minispeed.inference import (
    FusedGPTBlock,
    SamplingConfig,
    generate,
    init_inference,
    weight_bytes,
)

pytestmark = pytest.mark.timeout(300)


def _model(gpt_module, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = gpt_module.GPTConfig(vocab_size=37, block_size=24, n_layer=2, n_head=3, n_embd=24, **kw)
    return gpt_module.GPT(cfg).eval()


def test_injected_logits_equal_original(gpt_module, rel_close):
    model = _model(gpt_module)
    engine, report = init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    assert report.replaced == ("blocks.0", "blocks.1") and report.kept == ()
    assert all(isinstance(b, FusedGPTBlock) for b in engine.blocks)
    idx = torch.randint(0, 37, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = model(idx)
        got = engine(idx)
    rel_close(got, want)
    # the fused blocks share the original's weight tensors: no copy
    assert engine.blocks[0].qkv.weight.data_ptr() == model.blocks[0].attn.qkv.weight.data_ptr()


def test_unrecognised_block_is_kept_and_listed(gpt_module, rel_close):
    model = _model(gpt_module)

    class Custom(nn.Module):  # same math as Block, but not a type the policy knows
        def __init__(self, block):
            super().__init__()
            self.inner = block

        def forward(self, x):
            return self.inner(x)

    model.blocks[1] = Custom(model.blocks[1])
    engine, report = init_inference(model)
    assert report.replaced == ("blocks.0",)
    assert len(report.kept) == 1
    assert report.kept[0].startswith("blocks.1 (Custom: not the Block layout of examples/gpt.py")
    assert "Custom" in str(report)
    idx = torch.randint(0, 37, (2, 9))
    with torch.no_grad():
        rel_close(engine(idx), model(idx)[0])
    cfg = SamplingConfig(max_new_tokens=3)
    with pytest.raises(RuntimeError, match=r"block 1 \(Custom\) was not replaced.*use_cache=False"):
        generate(engine, [[1, 2]], cfg)
    assert generate(engine, [[1, 2]], cfg, use_cache=False) == generate(
        model, [[1, 2]], cfg, use_cache=False
    )


def test_int8_weights_are_4x_smaller_and_logits_stay_close(gpt_module):
    model = _model(gpt_module)
    engine, _ = init_inference(model, dtype=torch.int8)
    fp32_bytes = weight_bytes(model.blocks)
    int8_bytes = weight_bytes(engine.blocks)
    # N·K + 4N bytes against 4·N·K: ratio 4K/(K+4) = 3.43 at K = 24, → 4 as K grows
    assert fp32_bytes / int8_bytes > 3.3
    idx = torch.randint(0, 37, (2, 11))
    with torch.no_grad():
        want, _ = model(idx)
        got = engine(idx)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_bad_input_is_a_clear_error(gpt_module):
    with pytest.raises(ValueError, match="no injection policy recognises Linear"):
        init_inference(nn.Linear(3, 3))
    with pytest.raises(TypeError, match=r"float32 or torch\.int8"):
        init_inference(_model(gpt_module), dtype=torch.float16)


def test_without_kernel_inject_every_block_is_kept(gpt_module, rel_close):
    model = _model(gpt_module)
    engine, report = init_inference(model, replace_with_kernel_inject=False)
    assert report.replaced == () and len(report.kept) == 2
    idx = torch.randint(0, 37, (1, 5))
    with torch.no_grad():
        rel_close(engine(idx), model(idx)[0])
