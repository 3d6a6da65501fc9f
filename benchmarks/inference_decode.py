"""Decode tokens/s of the injected GPT (fused kernels + paged KV cache) against eager PyTorch, and
each fused kernel against its PyTorch reference, all in one run.

Run from the repository root::

    .venv/bin/python benchmarks/inference_decode.py            # small and 30M+ models, batch 1 and 16
    .venv/bin/python benchmarks/inference_decode.py --quick    # small model only
    .venv/bin/python benchmarks/inference_decode.py --only hf  # one section: decode, hf, profile, ttft

Variants, on the same model and prompts (greedy, so every variant emits the same tokens; checked):

- `eager`: examples/gpt.py's `GPT.generate`: a full forward over the context for every token;
- `injected`: `init_inference` + `generate(use_cache=True)`: prefill once, then one decode step per
  token over the paged cache with the C++ kernels;
- `injected-ref`: the same, with `MINISPEED_DISABLE_OPS=inference_kernels` (PyTorch reference
  kernels), which separates what the cache buys from what the kernels buy.

On Hugging Face's GPT-2 (a random config built locally; needs the `hf` extra, `--no-hf` skips
it), the same three-way comparison against `transformers`' own `generate` (greedy, its KV
cache): `eager` there is a full forward of the HF model per token. Then a `torch.profiler`
breakdown of one batch-1 generate of the small GPT: matmuls, the fused kernels, cache writes,
sampling, and the Python around them; and of one decode step of the injected 124M Hugging Face
models at each `--batches` size (each kernel timed around its call).

Each time is the best of `--rounds`. Ratios are over eager in the same run; every variant runs
with the same `--threads` (torch's intra-op pool and the op's OpenMP loops share one libgomp).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from timing import best_time

from minispeed.inference import ContinuousBatcher, SamplingConfig, generate, init_inference, kernels
from minispeed.inference.kernels import reference
from minispeed.inference.quantize import quantize_per_channel
from minispeed.inference.quantize import weight_bytes as linear_bytes

REPO = Path(__file__).resolve().parents[1]


def _gpt_module():
    spec = importlib.util.spec_from_file_location("bench_gpt", REPO / "examples/gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpt"] = module
    spec.loader.exec_module(module)
    return module


def bench_decode(gpt, size: str, batch: int, prompt_len: int, new: int, rounds: int) -> list[str]:
    dims = {"small": (4, 4, 128, 256), "30M": (8, 8, 512, 32768)}[size]  # layers, heads, C, V
    cfg = gpt.GPTConfig(vocab_size=dims[3], block_size=prompt_len + new, n_layer=dims[0],
                        n_head=dims[1], n_embd=dims[2])  # fmt: skip
    torch.manual_seed(0)
    model = gpt.GPT(cfg).eval()
    engine, _ = init_inference(model)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len))
    plist = prompts.tolist()
    scfg = SamplingConfig(max_new_tokens=new)

    def eager():
        with torch.no_grad():
            return model.generate(prompts, new, temperature=0)[:, prompt_len:].tolist()

    def injected():
        return generate(engine, plist, scfg)

    assert eager() == injected(), "injected and eager greedy tokens differ"
    t_eager = best_time(eager, rounds)
    t_inj = best_time(injected, rounds)
    os.environ["MINISPEED_DISABLE_OPS"] = "inference_kernels"
    try:
        t_ref = best_time(injected, rounds)
    finally:
        del os.environ["MINISPEED_DISABLE_OPS"]
    tokens = batch * new
    params = model.num_params() / 1e6
    return [
        f"| {size} ({params:.1f}M) | {batch} | {tokens / t_eager:.0f} | {tokens / t_inj:.0f} | "
        f"{tokens / t_ref:.0f} | {t_eager / t_inj:.2f}× | {t_eager / t_ref:.2f}× |"
    ]


# torch ops of a linear layer, self time (the fused kernels' own torch calls are not among them)
MATMUL_OPS = ("aten::addmm", "aten::mm", "aten::matmul", "aten::linear", "aten::t",
              "aten::transpose", "aten::expand", "aten::as_strided", "aten::_unsafe_view")  # fmt: skip


def hf_model(family: str, size: str, positions: int):
    """A Hugging Face model from a config, random weights (seed 0), built locally: no download.

    `124M`: GPT-2's own size (`GPT2Config()`: 12 layers, width 768, vocabulary 50257, tied
    head), and a LLaMA of about the same count (12 layers, width 768, 12 heads over 4 KV heads,
    SwiGLU width 2048, vocabulary 32000, its own head). `small` and `30M`: the sizes of the GPT rows.
    """
    import transformers

    torch.manual_seed(0)
    none = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if family == "gpt2":
        layers, heads, width, vocab = {
            "small": (4, 4, 128, 256), "30M": (8, 8, 512, 32768), "124M": (12, 12, 768, 50257),
        }[size]  # fmt: skip
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **none,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg).eval()
    layers, heads, width, vocab = {
        "small": (4, 4, 128, 256), "30M": (8, 8, 512, 32768), "124M": (12, 12, 768, 32000),
    }[size]  # fmt: skip
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=width * 8 // 3 // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 3 or 1,
        max_position_embeddings=positions, tie_word_embeddings=False, **none,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def streamed_weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads in full: every parameter but the embedding
    tables, of which a step gathers a row per sequence (GPT-2's tied `wte` is read whole, as the
    head)."""
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    gathered = [model.get_input_embeddings().weight] if not tied else []
    if hasattr(model, "transformer"):  # GPT-2's learned positions
        gathered.append(model.transformer.wpe.weight)
    skip = {id(p) for p in gathered}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def int8_streamed_bytes(model, fp32_bytes: int, engine, engine8) -> int:
    """`streamed_weight_bytes` of the int8 engine: the block linears at `N·K + 4·N` bytes and the
    output head at `V·C + 4·V` (Note [int8 vocabulary] in fused_gpt.py) instead of fp32's."""
    head8 = engine8.head_q
    return (
        fp32_bytes
        - linear_bytes(engine.blocks) + linear_bytes(engine8.blocks)
        - 4 * model.get_output_embeddings().weight.numel()
        + head8.weight_q.numel() + 4 * head8.scales.numel()
    )  # fmt: skip


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def copy_bandwidth(buffers: tuple[torch.Tensor, torch.Tensor], clock=time.perf_counter) -> float:
    """Bytes per second of one `dst.copy_(src)`, counted as STREAM counts a copy: read + written."""
    src, dst = buffers
    start = clock()
    dst.copy_(src)
    return 2 * src.numel() * src.element_size() / (clock() - start)


def bench_vs_transformers(
    family: str, size: str, batch: int, threads: int, prompt_len: int, new: int, rounds: int,
    int8: bool = False,
    clock=time.perf_counter,
) -> str:  # fmt: skip
    """One row: the same Hugging Face model and prompts decoded by transformers' `generate`
    (greedy, its KV cache) and by `init_inference` + `generate`, against the bandwidth floor.

    `int8`: a third contender, `init_inference(model, dtype=torch.int8)` (the block linears'
    weights, the token embedding and the output head as int8 copies), whose tokens are checked
    against the same int8 engine on the reference kernels (int8 changes the numerics, so not
    against transformers); the row reports how many of its tokens equal fp32's before the first
    difference in each sequence (summed over the batch). Its floor reads the streamed weights
    with the block linears and the head at int8 bytes (`int8_streamed_bytes`).

    A decode step's time is `(t(new + 1 tokens) - t(1 token)) / new` for each contender (the
    prefill and first token cancel). The floor reads the streamed weights once per step at the
    copy bandwidth of this run: `batch / (weight bytes / bandwidth)` tokens/s. Rounds interleave
    transformers, injected and a copy of a weight-sized buffer, so load from other jobs hits all
    three alike; the cells are medians over the rounds, the ratio's spread is its min-max.
    `clock`: wall time, or `time.process_time` (`--clock cpu`: the CPU time of every thread of
    the process, so turns other jobs take on the cores are not counted).
    """
    torch.set_num_threads(threads)
    model = hf_model(family, size, prompt_len + new + 1)
    engine, report = init_inference(model)
    assert not report.kept, report
    vocab = model.config.vocab_size
    prompts = torch.randint(
        0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(2)
    )
    mask = torch.ones_like(prompts)

    def hf(n: int) -> list[list[int]]:
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False)  # fmt: skip
        return out[:, prompt_len:].tolist()

    def injected(n: int) -> list[list[int]]:
        return generate(engine, prompts, SamplingConfig(max_new_tokens=n))

    got, want = injected(new + 1), hf(new + 1)
    assert got == want, f"{family} {size} batch {batch}: injected and transformers tokens differ"
    weight_bytes = streamed_weight_bytes(model)
    contenders = [("hf", hf), ("injected", injected)]
    if int8:
        engine8, _ = init_inference(model, dtype=torch.int8)

        def injected8(n: int) -> list[list[int]]:
            return generate(engine8, prompts, SamplingConfig(max_new_tokens=n))

        got = injected8(new + 1)
        os.environ["MINISPEED_DISABLE_OPS"] = "inference_kernels"
        try:
            want = injected8(new + 1)
        finally:
            del os.environ["MINISPEED_DISABLE_OPS"]
        assert got == want, f"{family} {size} batch {batch}: int8 op and reference tokens differ"
        contenders.append(("int8", injected8))
        bytes8 = int8_streamed_bytes(model, weight_bytes, engine, engine8)
        agree = sum(_common_prefix(a, b) for a, b in zip(got, injected(new + 1)))
    buffers = (torch.randn(weight_bytes // 4), torch.empty(weight_bytes // 4))
    copy_bandwidth(buffers)  # first touch of dst

    def step_seconds(gen) -> float:
        start = clock()
        gen(1)
        first = clock() - start
        start = clock()
        gen(new + 1)
        return (clock() - start - first) / new

    steps: dict[str, list[float]] = {name: [] for name, _ in contenders}
    steps["bw"] = []
    for r in range(rounds):
        order = contenders[:: 1 if r % 2 == 0 else -1]
        for name, gen in order:
            steps[name].append(step_seconds(gen))
        steps["bw"].append(copy_bandwidth(buffers, clock))
    med = {k: statistics.median(v) for k, v in steps.items()}
    ratios = [h / i for h, i in zip(steps["hf"], steps["injected"])]
    floor_step = weight_bytes / med["bw"]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    if int8:
        floor8 = bytes8 / med["bw"]
        ratios8 = [f / i for f, i in zip(steps["injected"], steps["int8"])]
        return (
            f"| HF {family} {size} ({params:.0f}M; {weight_bytes / 2**20:.0f} → "
            f"{bytes8 / 2**20:.0f} MiB streamed) | {batch} | {threads} | {med['bw'] / 1e9:.1f} "
            f"| {batch / floor8:.1f} | {batch / med['hf']:.1f} | {batch / med['injected']:.1f} "
            f"| {batch / med['int8']:.1f} | {agree}/{batch * (new + 1)} "
            f"| {statistics.median(ratios8):.2f}× [{min(ratios8):.2f}–{max(ratios8):.2f}] "
            f"| {med['hf'] / med['int8']:.2f}× | {floor8 / med['int8']:.2f} "
            f"| {os.getloadavg()[0]:.1f} |"
        )
    return (
        f"| HF {family} {size} ({params:.0f}M, {weight_bytes / 2**20:.0f} MiB streamed) | {batch} "
        f"| {threads} | {med['bw'] / 1e9:.1f} | {batch / floor_step:.1f} "
        f"| {batch / med['hf']:.1f} | {batch / med['injected']:.1f} "
        f"| {statistics.median(ratios):.2f}× [{min(ratios):.2f}–{max(ratios):.2f}] "
        f"| {floor_step / med['injected']:.2f} | {os.getloadavg()[0]:.1f} |"
    )


def profile_decode(gpt, prompt_len: int, new: int) -> list[str]:
    """Where a batch-1 decode of the small GPT spends its time (torch.profiler, one generate).

    The fused kernels' wrappers are wrapped in `record_function` for this run only, so their
    time (checks + the C++ call) shows as one row each; matmuls are torch's own ops."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cfg = gpt.GPTConfig(vocab_size=256, block_size=prompt_len + new, n_layer=4, n_head=4,
                        n_embd=128)  # fmt: skip
    torch.manual_seed(0)
    engine, _ = init_inference(gpt.GPT(cfg).eval())
    prompt = [torch.randint(0, 256, (prompt_len,)).tolist()]
    scfg = SamplingConfig(max_new_tokens=new)
    names = ("layer_norm", "bias_gelu", "decode_attention", "rms_norm", "rotary_embedding",
             "linear")  # fmt: skip
    originals = {n: getattr(kernels, n) for n in names}

    def traced(name, fn):
        def run(*args, **kwargs):
            with record_function(f"kernel.{name}"):
                return fn(*args, **kwargs)

        return run

    generate(engine, prompt, scfg)  # warm-up
    try:
        for n, fn in originals.items():
            setattr(kernels, n, traced(n, fn))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            generate(engine, prompt, scfg)
            wall = time.perf_counter() - start
    finally:
        for n, fn in originals.items():
            setattr(kernels, n, fn)
    rows = {e.key: e for e in prof.key_averages()}
    wall_us = wall * 1e6

    def total(prefix: str) -> float:
        return sum(e.cpu_time_total for k, e in rows.items() if k.startswith(prefix))

    def self_(keys: tuple[str, ...]) -> float:
        return sum(rows[k].self_cpu_time_total for k in keys if k in rows)

    parts = {
        "matmuls left to torch (aten::linear → addmm/mm)": self_(MATMUL_OPS),
        "fused kernels incl. kernels.linear (checks + C++), kernel.*": total("kernel."),
        "sampling (argmax, list out)": total("inference.sample"),
        "KV-cache writes (index_copy_)": self_(("aten::index_copy_",)),
        "embeddings (aten::embedding)": self_(("aten::embedding", "aten::index_select")),
    }
    out = [f"| {k} | {v / 1e3:.1f} | {100 * v / wall_us:.0f} % |" for k, v in parts.items()]
    rest = wall_us - sum(parts.values())
    out.append(f"| everything else (Python: module calls, generate loop, tensor glue) | "
               f"{rest / 1e3:.1f} | {100 * rest / wall_us:.0f} % |")  # fmt: skip
    out.append(f"| **total** ({new} tokens, batch 1) | {wall * 1e3:.1f} | 100 % |")
    return out


def profile_hf_step(
    family: str, batch: int, prompt_len: int, new: int, clock=time.perf_counter,
    dtype: torch.dtype = torch.float32,
) -> list[str]:  # fmt: skip
    """Where one decode step of the injected 124M HF model goes, at `batch` sequences (`dtype`:
    `init_inference`'s, fp32 or int8).

    Each call into the C++ op (`kernels.load_op()`'s functions, which both the kernel wrappers
    and the decode plan call: Note [decode step as raw op calls]) is timed by `clock` around
    it for this run only, and a step is `(t(new + 1 tokens) - t(1 token)) / new` as in the
    transformers rows; the rest (wrappers, the plan's Python, cache writes, embeddings, tables)
    is what remains. A GPT step's blocks are one `gpt_layers` call, timed whole (the kernels it
    calls from C++ are not seen apart: Note [the GPT blocks in one call]). torch.profiler is not used here: its per-op bookkeeping made the small
    kernels of a batch-8 step look 5-10× longer than they run (a layer norm of 8 × 768: 0.5 ms
    profiled, 0.06 ms timed).
    """
    model = hf_model(family, "124M", prompt_len + new + 1)
    engine, _ = init_inference(model, dtype=dtype)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                            generator=torch.Generator().manual_seed(2))  # fmt: skip
    head_rows = model.config.vocab_size
    spent: dict[str, float] = {}
    op = kernels.load_op()

    def timed(name, fn):
        def run(*args):
            part = name
            if name in ("linear", "int8_linear"):  # (x, w, [scales,] b, out, M, N, ...)
                part = "head" if args[6 if name == "int8_linear" else 5] == head_rows else "linear"
            start = clock()
            out = fn(*args)
            spent[part] = spent.get(part, 0.0) + clock() - start
            return out

        return run

    names = ("linear", "linear_many", "swiglu", "decode_attention", "layer_norm", "rms_norm",
             "bias_gelu", "bias_gelu_tanh", "rotary", "argmax_rows", "int8_linear",
             "gpt_layers")  # fmt: skip
    originals = {n: getattr(op, n) for n in names}

    def run(n: int) -> tuple[float, dict[str, float]]:
        spent.clear()
        start = clock()
        generate(engine, prompts, SamplingConfig(max_new_tokens=n))
        return clock() - start, dict(spent)

    try:
        for n, fn in originals.items():
            setattr(op, n, timed(n, fn))
        run(new + 1)  # warm-up
        (w1, s1), (w2, s2) = run(1), run(new + 1)
    finally:
        for n, fn in originals.items():
            setattr(op, n, fn)
    step = (w2 - w1) / new
    per = {k: (v - s1.get(k, 0.0)) / new for k, v in s2.items()}
    labels = {
        "linear": "block linears (op linear, linear_many, swiglu, int8_linear: weights read once)",
        "linear_many": "block linears (op linear, linear_many, swiglu, int8_linear: weights read once)",
        "swiglu": "block linears (op linear, linear_many, swiglu, int8_linear: weights read once)",
        "head": "output head (op linear or int8_linear over the vocabulary)",
        "decode_attention": "paged decode attention",
        "layer_norm": "norms (add + LayerNorm / RMSNorm)",
        "rms_norm": "norms (add + LayerNorm / RMSNorm)",
        "bias_gelu": "bias + GeLU",
        "bias_gelu_tanh": "bias + GeLU",
        "rotary": "rotary",
        "argmax_rows": "greedy argmax (kernels.argmax)",
        "gpt_layers": "GPT blocks in one op call (gpt_layers: block linears, attention, norms, "
        "GeLU, cache writes, residual adds)",
    }
    parts: dict[str, float] = {}
    for k, v in per.items():
        parts[labels[k]] = parts.get(labels[k], 0.0) + v
    name = f"{family} 124M{' int8' if dtype == torch.int8 else ''}, batch {batch}"
    out = [f"| {name} | {k} | {v * 1e3:.2f} | {100 * v / step:.0f} % |"
           for k, v in sorted(parts.items(), key=lambda kv: -kv[1])]  # fmt: skip
    rest = step - sum(parts.values())
    out.append(f"| {name} | everything else (Python: wrappers, the plan's calls; cache writes, "
               f"residual adds, SiLU·up, embeddings, tables) | {rest * 1e3:.2f} | "
               f"{100 * rest / step:.0f} % |")  # fmt: skip
    out.append(f"| {name} | **step** (load {os.getloadavg()[0]:.1f}) | "
               f"{step * 1e3:.2f} | 100 % |")  # fmt: skip
    return out


def bench_ttft(family: str, batch: int, prompt_len: int, rounds: int, clock=time.perf_counter,
               dtype: torch.dtype = torch.float32) -> str:  # fmt: skip
    """One row: a prefill of `batch` prompts of the injected 124M model with every position's
    logits (what `generate` computed before) against `last_only=True` (what it asks for now:
    Note [prefill: the last position's logits only]), alternated, median of `rounds` each; the
    first token's logits are checked equal (int8) or close (fp32)."""
    model = hf_model(family, "124M", prompt_len + 1)
    engine, _ = init_inference(model, dtype=dtype)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                            generator=torch.Generator().manual_seed(2))  # fmt: skip
    ids = list(range(batch))

    def prefill(last_only: bool) -> tuple[float, torch.Tensor]:
        cache = engine.new_cache(batch * -(-prompt_len // 16), 16)
        for i in ids:
            cache.add_sequence(i)
        start = clock()
        with torch.no_grad():
            logits = engine.prefill_many(prompts, cache, ids, last_only=last_only)
        return clock() - start, logits[:, -1]

    full, last = prefill(False)[1], prefill(True)[1]
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for last_only in (False, True) if r % 2 == 0 else (True, False):
            times[last_only].append(prefill(last_only)[0])
    t_full, t_last = statistics.median(times[False]), statistics.median(times[True])
    kind = "int8" if dtype == torch.int8 else "fp32"
    return (f"| {family} 124M {kind} | {batch} | {prompt_len} | {t_full * 1e3:.1f} | "
            f"{t_last * 1e3:.1f} | {t_full / t_last:.2f}× | {os.getloadavg()[0]:.1f} |")  # fmt: skip


def bench_batching(gpt, rounds: int) -> list[str]:
    """16 requests of mixed lengths: one after another vs continuous batching (max_batch 16)."""
    cfg = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    torch.manual_seed(0)
    engine, _ = init_inference(gpt.GPT(cfg).eval())
    g = torch.Generator().manual_seed(1)
    reqs = []
    for i in range(16):
        plen, new = 4 + (i * 7) % 25, 8 + (i * 5) % 25  # prompts 4-28, 8-32 new tokens
        prompt = torch.randint(0, 256, (plen,), generator=g).tolist()
        reqs.append((prompt, SamplingConfig(max_new_tokens=new, temperature=0.8, top_k=40, seed=i)))
    blocks = sum(-(-(len(p) + c.max_new_tokens) // 16) for p, c in reqs)

    def sequential():
        return [generate(engine, [p], c)[0] for p, c in reqs]

    def batched():
        b = ContinuousBatcher(engine, num_blocks=blocks, kv_block_size=16, max_batch=16)
        ids = [b.submit(p, c) for p, c in reqs]
        res = b.run()
        return [res[i].tokens for i in ids]

    assert sequential() == batched(), "continuous batching changed some request's tokens"
    tokens = sum(c.max_new_tokens for _, c in reqs)
    t_seq, t_bat = best_time(sequential, rounds), best_time(batched, rounds)
    return [f"| 16 mixed requests, small model | {tokens / t_seq:.0f} | {tokens / t_bat:.0f} | "
            f"{t_seq / t_bat:.2f}× |"]  # fmt: skip


def bench_kernels(rounds: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    R, C = 64, 1024
    x, r = torch.randn(R, C, generator=g), torch.randn(R, C, generator=g)
    w, b = torch.randn(C, generator=g), torch.randn(C, generator=g)
    s = torch.randn(64, 256, 256, generator=g)
    mask = torch.ones(256, 256, dtype=torch.bool).tril()
    cos, sin = kernels.rotary_tables(512, 64)
    xr, pos = torch.randn(256, 16, 64, generator=g), torch.randint(0, 512, (256,), generator=g)
    B, H, D, BS, L = 16, 8, 64, 16, 256
    kc, vc = (
        torch.randn(B * L // BS, BS, H, D, generator=g),
        torch.randn(B * L // BS, BS, H, D, generator=g),
    )
    q = torch.randn(B, H, D, generator=g)
    tables = torch.arange(B * L // BS, dtype=torch.int32).view(B, L // BS)
    lens = torch.full((B,), L)
    wq, sc = quantize_per_channel(torch.randn(2048, 1024, generator=g))
    xl = torch.randn(4, 1024, generator=g)
    cases = {
        "add + LayerNorm (64×1024)": lambda m: m.layer_norm(x, w, b, residual=r),
        "add + RMSNorm (64×1024)": lambda m: m.rms_norm(x, w, residual=r),
        "bias + GeLU (64×1024)": lambda m: m.bias_gelu(x, b),
        "masked softmax (64×256×256, causal)": lambda m: m.masked_softmax(s, mask),
        "rotary (256 tok × 16 h × 64)": lambda m: m.rotary_embedding(xr, pos, cos, sin),
        "decode attention (16 seq × 8 h × 256 ctx)": lambda m: m.decode_attention(
            q, kc, vc, tables, lens
        ),
        "int8 linear (4×1024 → 2048)": lambda m: m.int8_linear(xl, wq, sc, None),
    }
    rows = []
    for name, fn in cases.items():
        fn(kernels)  # warm-up (and the op load)
        t_op = best_time(lambda fn=fn: fn(kernels), rounds)
        t_ref = best_time(lambda fn=fn: fn(reference), rounds)
        rows.append(f"| {name} | {t_op * 1e6:.0f} | {t_ref * 1e6:.0f} | {t_ref / t_op:.2f}× |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--no-hf", dest="hf", action="store_false",
        help="skip the transformers rows (they need pip install packages/inference[hf])",
    )  # fmt: skip
    parser.add_argument("--only", choices=("decode", "hf", "profile", "ttft"),
                        help="run one section")  # fmt: skip
    parser.add_argument("--families", nargs="+", default=["gpt2", "llama"], choices=("gpt2", "llama"),
                        help="Hugging Face families of the hf section")  # fmt: skip
    parser.add_argument("--hf-sizes", nargs="+", default=["124M"], choices=("small", "30M", "124M"),
                        help="model sizes of the hf section (--quick: small)")  # fmt: skip
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8],
                        help="batch sizes of the hf section")  # fmt: skip
    parser.add_argument("--threads-list", nargs="+", type=int, default=[1, 2],
                        help="thread counts of the hf section (each row sets its own)")  # fmt: skip
    parser.add_argument("--int8", action="store_true",
                        help="hf section: add init_inference(dtype=torch.int8) to every row; "
                        "profile section: profile the int8 engine")  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch and OpenMP threads for every variant (default 1: on a machine shared with "
        "other jobs, spinning OpenMP threads made every variant 5-10x slower at 2)",
    )  # fmt: skip
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="time the hf and profile sections by wall time or by the process's CPU time (cpu: "
        "other jobs' turns on the cores are not counted)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dtype = torch.int8 if args.int8 else torch.float32
    torch.set_num_threads(args.threads)
    op = kernels.load_op()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"op SIMD level: {op.simd_level() if op else 'none (reference)'}")  # fmt: skip
    gpt = _gpt_module()
    sizes = ("small",) if args.quick else ("small", "30M")

    def wanted(section: str) -> bool:
        return args.only in (None, section)

    if wanted("decode"):
        print("\n| model | batch | eager tok/s | injected tok/s | injected-ref tok/s | "
              "injected / eager | injected-ref / eager |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for size in sizes:
            for batch in (1, 16):
                for row in bench_decode(
                    gpt, size, batch, args.prompt_len, args.new_tokens, args.rounds
                ):
                    print(row, flush=True)
    if args.hf and wanted("hf"):
        print("\nThe same Hugging Face model (random config, built locally) and prompts, decoded by "
              "transformers' generate and by init_inference + generate (same greedy tokens: "
              "checked), against the floor (the streamed weights read once per step at the copy "
              f"bandwidth measured in the same rounds); medians of {args.rounds} interleaved "
              f"rounds, {args.clock} time, tokens/s:")  # fmt: skip
        if args.int8:
            print("\n| model | batch | threads | copy GB/s | int8 floor tok/s | transformers tok/s "
                  "| injected fp32 tok/s | injected int8 tok/s | int8 = fp32 tokens "
                  "| fp32 / int8 step [min–max] | int8 / transformers | int8 / int8 floor "
                  "| load |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        else:
            print(
                "\n| model | batch | threads | copy GB/s | floor tok/s | transformers tok/s | "
                "injected tok/s | injected / transformers [min–max] | injected / floor | load |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
        for family in args.families:
            for size in ("small",) if args.quick else args.hf_sizes:
                for threads in args.threads_list:
                    for batch in args.batches:
                        row = bench_vs_transformers(family, size, batch, threads, args.prompt_len,
                                                    args.new_tokens, args.rounds, args.int8,
                                                    clock)  # fmt: skip
                        print(row, flush=True)
        torch.set_num_threads(args.threads)
    if args.hf and wanted("ttft") and not args.quick:
        print("\nTime to the first token's logits: a prefill of the injected 124M model with "
              "every position's logits (before) and the last position's only (now), "
              f"{args.clock} time, medians of {args.rounds} alternated rounds, ms:")  # fmt: skip
        print("\n| model | batch | prompt | all positions | last only | ratio | load |")
        print("|---|---|---|---|---|---|---|")
        for family in args.families:
            for dt in (torch.float32, torch.int8):
                for batch in args.batches:
                    print(bench_ttft(family, batch, args.prompt_len, max(args.rounds, 5), clock,
                                     dt), flush=True)  # fmt: skip
    if wanted("profile"):
        print("\nWhere a batch-1 decode of the small GPT spends its time (torch.profiler):")
        print("\n| part | ms | share |")
        print("|---|---|---|")
        for row in profile_decode(gpt, args.prompt_len, args.new_tokens):
            print(row, flush=True)
        if args.hf and not args.quick:
            print("\nWhere a decode step of the injected 124M Hugging Face models goes (each kernel "
                  "timed around its call; ms per step):")  # fmt: skip
            print("\n| model | part | ms | share |")
            print("|---|---|---|---|")
            for family in args.families:
                for batch in args.batches:
                    for row in profile_hf_step(family, batch, args.prompt_len, args.new_tokens,
                                               clock, dtype):  # fmt: skip
                        print(row, flush=True)
    if args.only is not None:
        return 0
    print("\n| workload | one after another tok/s | continuous batching tok/s | ratio |")
    print("|---|---|---|---|")
    for row in bench_batching(gpt, args.rounds):
        print(row, flush=True)
    print("\n| kernel | op µs | reference µs | reference / op |")
    print("|---|---|---|---|")
    for row in bench_kernels(max(args.rounds, 5)):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
