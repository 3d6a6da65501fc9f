"""`minispeed.engine.init_inference` (DeepSpeed's call): returns the engine, not a tuple, whose
logits equal the original model's; config and keyword arguments merge (keywords win); DeepSpeed's
other keys are accepted at their defaults and refused, by name, elsewhere."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from minispeed.engine.inference import init_inference

ROOT = Path(__file__).resolve().parents[2]


def _gpt():
    spec = importlib.util.spec_from_file_location("example_gpt", ROOT / "examples" / "gpt.py")
    gpt = sys.modules.setdefault("example_gpt", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(gpt)  # registered first: its dataclasses look their module up
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab_size=37, block_size=24, n_layer=2, n_head=3, n_embd=24)
    return gpt.GPT(cfg).eval()


def test_init_inference_returns_the_engine_with_the_models_logits():
    model = _gpt()
    engine = init_inference(
        model, config={"dtype": "int8", "enable_cuda_graph": False}, dtype=torch.float32,
        replace_with_kernel_inject=True,
    )  # fmt: skip
    assert engine.injection_report.replaced == ("blocks.0", "blocks.1")
    assert engine.injection_report.dtype == torch.float32  # the keyword won over the config
    idx = torch.randint(0, 37, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = model(idx)
        got = engine(idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,error,word",
    [
        ({"enable_cuda_graph": True}, NotImplementedError, "enable_cuda_graph"),
        ({"dtype": "fp16"}, TypeError, "fp16"),
        ({"replace_with_kernal_inject": True}, ValueError, "replace_with_kernel_inject"),
    ],
)
def test_unsupported_options_are_refused_by_name(kwargs, error, word):
    with pytest.raises(error, match=word):
        init_inference(_gpt(), **kwargs)
