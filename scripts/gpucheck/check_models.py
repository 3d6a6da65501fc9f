"""Kernel injection of Hugging Face GPT-2 and LLaMA on the device, and decode speed.

`inject.gpt2` / `inject.llama` (tiny random configs, built locally, no download): the model on
the device, `init_inference(model)`; every block must be fused (the report names none kept);
the engine's logits against the model's own (fp32 both, on the device: ‖Δ‖/‖ref‖ against
`TOL["fp32"]`), and greedy tokens from `minispeed.inference.generate` (paged KV cache, fused
kernels) against transformers' `model.generate` for two prompts: sequences differing must be 0.

`speed.decode`: GPT-2 at its 124M shape and LLaMA at TinyLlama's 1.1B shape (random weights,
fp32: the injected path takes fp32 only), 32-token prompts, 64 new tokens, batch 1 and 8:
tokens per second of `generate` on the injected engine against transformers' `generate` on
the same model (greedy, same tokens asserted), wall time of the whole call (prefill included).
Goal (issue 33): at least 2× transformers at batch 1.
"""

from __future__ import annotations

from gpucheck.harness import TOL, Ctx, Report, rel_err


def _gpt2(tiny: bool):
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=53, n_positions=64, n_embd=48, n_layer=2, n_head=3,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    ) if tiny else transformers.GPT2Config(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _llama(tiny: bool):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
        bos_token_id=0, eos_token_id=1, pad_token_id=None,
    ) if tiny else transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _build(ctx: Ctx, family: str, tiny: bool):
    import torch

    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = (_gpt2 if family == "gpt2" else _llama)(tiny)
    model.eval()
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = None, 0, None  # never stop early
    return model


def _hf_tokens(model, prompts, new: int) -> list[list[int]]:
    import torch

    ids = torch.tensor(prompts, device=model.device)
    with torch.no_grad():
        # An explicit mask: without one, transformers masks every prompt token equal to the
        # pad id, which random prompts contain.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, use_cache=True)  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def _differing(model, prompts, ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, str]:
    """How many sequences differ, and where the first one does, with transformers' top-2 logit
    margin there (a margin near fp32 rounding is a tie, not a bug)."""
    import torch

    bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if not bad:
        return 0, ""
    a, b = ours[bad[0]], theirs[bad[0]]
    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    ids = torch.tensor([prompts[bad[0]] + b[:at]], device=model.device)
    with torch.no_grad():
        top2 = model(ids).logits[0, -1].topk(2).values
    margin = float(top2[0] - top2[1])
    return len(bad), f"sequence {bad[0]} first differs at new token {at}; margin {margin:.2e}"


def _inject(ctx: Ctx, report: Report, family: str) -> None:
    import torch

    from minispeed.inference import SamplingConfig, generate, init_inference

    model = _build(ctx, family, tiny=True)
    engine, inj = init_inference(model)
    report.info("blocks fused", len(inj.replaced), note=f"policy {inj.policy}")
    report.check("blocks kept unfused", len(inj.kept), 0, unit="", note="; ".join(inj.kept))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(6)
    idx = torch.randint(0, vocab, (2, 19), generator=gen).to(ctx.device)
    with torch.no_grad():
        got, want = engine(idx), model(idx).logits
    report.check("logits against transformers (full forward)", rel_err(got, want), TOL["fp32"])
    prompts = torch.randint(0, vocab, (2, 8), generator=gen).tolist()
    new = 16
    ours = generate(engine, prompts, SamplingConfig(max_new_tokens=new))
    n_bad, where = _differing(model, prompts, ours, _hf_tokens(model, prompts, new))
    report.check(f"greedy tokens (2 prompts × {new}) differing from transformers' generate",
                 n_bad, 0, unit="sequences", note=where)  # fmt: skip


def inject_gpt2(ctx: Ctx, report: Report) -> None:
    _inject(ctx, report, "gpt2")


def inject_llama(ctx: Ctx, report: Report) -> None:
    _inject(ctx, report, "llama")


def decode_speed(ctx: Ctx, report: Report) -> None:
    prompt_len, new = ctx.pick((32, 64), (8, 8))
    for family in ("gpt2", "llama"):
        _decode_family(ctx, report, family, prompt_len, new)
        ctx.free()


def _decode_family(ctx: Ctx, report: Report, family: str, prompt_len: int, new: int) -> None:
    import torch

    from minispeed.inference import SamplingConfig, generate, init_inference

    model = _build(ctx, family, tiny=ctx.dry_run)
    n_params = sum(p.numel() for p in model.parameters())
    engine, _ = init_inference(model)
    vocab = model.config.vocab_size
    cfg = SamplingConfig(max_new_tokens=new)
    for batch in (1, 8):
        gen = torch.Generator().manual_seed(7 + batch)
        prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()
        ours = generate(engine, prompts, cfg)
        n_bad, where = _differing(model, prompts, ours, _hf_tokens(model, prompts, new))
        label = f"{family} ({n_params / 1e6:.0f}M) batch {batch}"
        report.check(f"{label}: sequences differing from transformers", n_bad, 0,
                     unit="sequences", note=where)  # fmt: skip
        t_ours = ctx.wall(lambda prompts=prompts: generate(engine, prompts, cfg), reps=3)
        t_hf = ctx.wall(lambda prompts=prompts: _hf_tokens(model, prompts, new), reps=3)
        tokens = batch * new
        report.info(f"{label}: injected", tokens / t_ours, "tok/s")
        report.info(f"{label}: transformers", tokens / t_hf, "tok/s")
        if batch == 1:
            report.goal(f"{label}: injected / transformers", t_hf / t_ours, 2.0, "×")
        else:
            report.info(f"{label}: injected / transformers", t_hf / t_ours, "×")
