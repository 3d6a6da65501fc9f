"""Generate text from a consolidated checkpoint: the fp32 state_dict loaded into a plain ``GPT``.

No ZeRO and no process group here: ``train_gpt.py`` saved a sharded checkpoint and joined it into
one ordinary ``torch.save`` file (``consolidated_fp32.pt``), which any single process can load.
The model's shape and the tokenizer's vocabulary come from the run's ``metrics.json``::

    python examples/sample.py --run-dir .minispeed/demo --prompt "The gradients " --tokens 300

Sampling is plain: temperature 0 is greedy, otherwise softmax sampling at that temperature,
optionally limited to the ``top_k`` most likely characters (see ``GPT.generate``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt.py, data.py beside this file

from data import CharTokenizer
from gpt import GPT, GPTConfig

__all__ = ["generate_text", "load_model"]


def load_model(run_dir: str | Path) -> tuple[GPT, CharTokenizer]:
    """The trained model (fp32, eval mode) and its tokenizer, from a ``train_gpt.py`` run folder."""
    run_dir = Path(run_dir)
    metrics_file = run_dir / "metrics.json"
    if not metrics_file.exists():
        raise FileNotFoundError(
            f"{metrics_file} not found; train first (examples/train_gpt.py --out-dir {run_dir})"
        )
    metrics = json.loads(metrics_file.read_text())
    weights = Path(metrics.get("consolidated_file", run_dir / "consolidated_fp32.pt"))
    if not weights.exists():
        raise FileNotFoundError(
            f"{weights} not found; the run saved no consolidated checkpoint (was --no-checkpoint given?)"
        )
    model = GPT(GPTConfig(**metrics["model"]))
    state = torch.load(weights, map_location="cpu", weights_only=True)
    model.load_state_dict(state)  # strict: every parameter name and shape must match
    model.eval()
    return model, CharTokenizer(metrics["tokenizer_chars"])


def generate_text(
    model: GPT,
    tokenizer: CharTokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """``prompt`` followed by ``max_new_tokens`` generated characters."""
    idx = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)  # (1, T)
    g = torch.Generator().manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=g)
    return tokenizer.decode(out[0].tolist())


def main(argv: list[str] | None = None) -> None:
    """Command line: load a run's consolidated weights and print a sample."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default=".minispeed/demo", help="train_gpt.py --out-dir of the run")
    p.add_argument("--prompt", default="The ")
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model, tok = load_model(args.run_dir)
    print(
        generate_text(model, tok, args.prompt, args.tokens, args.temperature, args.top_k, args.seed)
    )


if __name__ == "__main__":
    main()
