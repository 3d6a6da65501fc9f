"""`tp_model_init` then `initialize` (DeepSpeed's AutoTP training path, without the Trainer): the
record fills `tensor_parallel.autotp_size`, the model is cut by its structure and its own loss
trains. On 2 gloo ranks (tensor 2) a Qwen2 (GQA, q/k/v biases) at ZeRO-3 takes the losses and
gradient norms of one process running torch's AdamW on the unsplit model (and, given to
`initialize` without `tp_model_init`, is cut the same way: whole logits); a model built under
`zero.Init` is refused on every rank, naming a parameter; a record that disagrees with the config
is refused naming both."""

from __future__ import annotations

import pytest
import torch

from minispeed.core.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

VOCAB, STEPS, LR, CLIP = 48, 4, 1e-2, 0.5


def _qwen2():
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False, pad_token_id=None, use_cache=False,
    ))  # fmt: skip


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(STEPS)]


CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3},
    "gradient_clipping": CLIP,
}


def _body(rank: int, world_size: int) -> dict:
    import minispeed.engine as deepspeed
    import minispeed.zero as zero

    model = deepspeed.tp_model_init(_qwen2(), tp_size=2, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)  # no tensor_parallel section
    steps = []
    for ids in _batches():
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        steps.append((loss.item(), engine.get_global_grad_norm()))
    out = {"steps": steps, "tensor": engine.autotp_size()}
    # without tp_model_init: a model with no ready plan is cut by its structure too
    plain, *_ = deepspeed.initialize(
        model=_qwen2(),
        config={**CONFIG, "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}},
    )
    with torch.no_grad():
        out["first"] = plain(input_ids=_batches()[0], labels=_batches()[0])
    with zero.Init():
        built = _qwen2()
    deepspeed.tp_model_init(built, tp_size=2, dtype=torch.float32)
    try:
        deepspeed.initialize(model=built, config=CONFIG)
    except ValueError as err:
        out["refused"] = str(err)
    return out


def test_tp_model_init_trains_at_zero3_like_one_process():
    results = run_distributed(_body, world_size=2, timeout_s=240)
    model = _qwen2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    want = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        want.append((loss.item(), norm.item()))
    first = _qwen2()(input_ids=_batches()[0], labels=_batches()[0])
    for r in results:
        assert r["tensor"] == 2
        torch.testing.assert_close(r["first"].logits, first.logits.detach())  # whole (B, T, V)
        assert r["first"].loss.item() == pytest.approx(first.loss.item(), rel=1e-6)
        for (loss, norm), (want_loss, want_norm) in zip(r["steps"], want, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert norm == pytest.approx(want_norm, rel=1e-4)
        assert "ZeRO-3 shards already" in r["refused"] and "'model." in r["refused"]


def test_a_record_that_disagrees_with_the_config_is_refused():
    from minispeed.engine.runtime.tensor_parallel import merge_recorded, tp_model_init

    model = tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32)
    assert merge_recorded({}, model)["tensor_parallel"] == {"autotp_size": 2}
    with pytest.raises(ValueError, match=r"autotp_size is 4 in the config but tp_model_init"):
        merge_recorded({"tensor_parallel": {"autotp_size": 4}}, model)
    with pytest.raises(ValueError, match=r"dtype=torch.float32 but the config enables torch.bf"):
        merge_recorded({"bf16": {"enabled": True}}, model)
    with pytest.raises(NotImplementedError, match="tp_group"):
        tp_model_init(model, tp_size=2, dtype=torch.float32, tp_group=object())
