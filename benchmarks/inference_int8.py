"""int8 weight-only inference: weight memory and held-out perplexity against fp32, in one run.

Run from the repository root::

    .venv/bin/python benchmarks/inference_int8.py                    # train the demo GPT, then measure
    .venv/bin/python benchmarks/inference_int8.py --run-dir .minispeed/demo   # the checkpoint of `make demo`
    .venv/bin/python benchmarks/inference_int8.py --steps 100        # shorter training

The demo model is examples/train_gpt.py's default shape (3 layers, 4 heads, width 96, 64-token
context, character vocabulary of the bundled corpus). Without `--run-dir` it is trained here in
one process with the demo's optimizer settings (AdamW lr 6e-3, betas 0.9/0.99, weight decay
0.01, 20 linear warm-up steps, gradient clipping 1.0, 32 windows per step): the same
examples ZeRO-3 on 2 ranks sees, without the sharding.

Reported: bytes of the blocks' linear weights, bytes of the whole model (`held_bytes`: with
`dtype=torch.int8` the token embedding and tied head are int8 rows too; norms, biases and
learned positions stay fp32), and the perplexity of the corpus' held-out
10 % (`minispeed.inference.perplexity`, 64-token windows) for the fp32 and the int8 model.
A second row gives the memory of a 42M-parameter GPT (random weights: no perplexity).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from minispeed.inference import init_inference, perplexity, weight_bytes
from minispeed.inference.quantize import held_bytes

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

from data import CharDataset  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def train_demo(steps: int, seed: int = 1234) -> tuple[GPT, CharDataset]:
    ds = CharDataset.from_file()
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=ds.tokenizer.vocab_size, block_size=64, n_layer=3, n_head=4,
                    n_embd=96)  # fmt: skip
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3, betas=(0.9, 0.99), weight_decay=0.01)
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 6e-3 * min(1.0, (step + 1) / 20)
        x, y = ds.batch("train", step, 32, cfg.block_size, seed)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            print(f"  step {step + 1}/{steps}: train loss {loss.item():.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    return model.eval(), ds


def load_run(run_dir: str) -> tuple[GPT, CharDataset]:
    from sample import load_model

    model, tok = load_model(run_dir)
    return model, CharDataset((REPO / "examples/data/corpus.txt").read_text(), tok)


def memory_row(name: str, model: GPT, engine) -> str:
    wb32, wb8 = weight_bytes(model.blocks), weight_bytes(engine.blocks)
    mb32, mb8 = held_bytes(model), held_bytes(engine)
    return (f"| {name} ({model.num_params() / 1e6:.2f}M) | {wb32 / 2**20:.2f} | {wb8 / 2**20:.2f} | "
            f"{wb32 / wb8:.2f}× | {mb32 / 2**20:.2f} | {mb8 / 2**20:.2f} | {mb32 / mb8:.2f}× |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="training steps (the demo's default)")
    p.add_argument("--run-dir", help="use the consolidated checkpoint of a train_gpt.py run")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.run_dir:
        model, ds = load_run(args.run_dir)
        print(f"model from {args.run_dir}")
    else:
        print(f"training the demo GPT for {args.steps} steps ({args.threads} thread)")
        model, ds = train_demo(args.steps)
    fp32, _ = init_inference(model)
    int8, _ = init_inference(model, dtype=torch.int8)
    val, T = ds.splits["val"], model.cfg.block_size
    ppl32, ppl8 = perplexity(fp32, val, T), perplexity(int8, val, T)
    print("\n| model | fp32 ppl | int8 ppl | int8 / fp32 − 1 |")
    print("|---|---|---|---|")
    print(f"| demo GPT, held-out {val.numel()} chars | {ppl32:.3f} | {ppl8:.3f} | "
          f"{100 * (ppl8 / ppl32 - 1):+.3f} % |")  # fmt: skip
    print("\n| model | block linears fp32 MiB | int8 MiB | ratio | whole model fp32 MiB | "
          "int8 MiB | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    print(memory_row("demo GPT", model, int8))
    big = GPT(GPTConfig(vocab_size=32768, block_size=64, n_layer=8, n_head=8, n_embd=512)).eval()
    print(memory_row("30M-class GPT", big, init_inference(big, dtype=torch.int8)[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
