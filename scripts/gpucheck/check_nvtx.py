"""NVTX ranges of a real CUDA training step, as an NVTX tool sees them.

The project's capture tool (`minispeed/profiler/csrc/nvtx_capture/nvtx_capture.c`, the way
Nsight Systems attaches: `NVTX_INJECTION64_PATH`) is built with gcc against CUDA's `nvtx3`
headers; a child process then trains one ZeRO-3 step of a small GPT on the GPU (NCCL, world
size 1) inside `profiler.range("check.step")` and `profiler.module_ranges(model)`, with the tool
injected. The capture must be balanced (as many pops as pushes, the depth never below zero) and
nested (the step's range opens first and closes last, so every other range lies inside it), and
must hold the packages' own ranges (`zero.*`, the model's modules). Which binding pushed them is
recorded: the `nvtx` package, or `torch.cuda.nvtx` where that package is absent (as on the
device image).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from gpucheck.harness import REPO, Ctx, Report

CAPTURE_C = REPO / "packages/profiler/src/minispeed/profiler/csrc/nvtx_capture/nvtx_capture.c"

STEP = """
import json, sys
import torch
sys.path.insert(0, {scripts!r})
from gpucheck.harness import gpt_module
import minispeed.comm as comm
import minispeed.zero as zero
from minispeed import profiler
from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator

comm.init_distributed()
device = get_accelerator().device()
torch.manual_seed(0)
G = gpt_module()
with torch.device(device):
    model = G.GPT(G.GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32))
opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                 config=zero.ZeroConfig(stage=3))
idx = torch.randint(0, 97, (2, 32), device=device)
with profiler.range("check.step"):
    with profiler.module_ranges(model, depth=1):
        _, loss = model(idx, idx)
    opt.backward(loss)
    opt.step()
get_accelerator().synchronize()
torch_binding = getattr(ranges._push, "__module__", "") == "torch.cuda.nvtx"
binding = "torch.cuda.nvtx" if torch_binding else "the nvtx package"
if not profiler.nvtx_enabled():
    binding = "none: neither the nvtx package nor an NVTX-enabled torch"
print(json.dumps({{"enabled": profiler.nvtx_enabled(), "binding": binding,
                   "loss": float(loss)}}))
"""


def _nvtx_include() -> Path | None:
    """A directory holding `nvtx3/nvToolsExt.h`: CUDA's include/ or the pip wheels'."""
    candidates = [Path("/usr/local/cuda/include")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    for site in sys.path:
        candidates += sorted(Path(site).glob("nvidia/*/include")) if site else []
    return next((d for d in candidates if (d / "nvtx3" / "nvToolsExt.h").is_file()), None)


def build_capture_lib(scratch: Path) -> tuple[Path, float]:
    """Build the capture tool into `scratch` (once per run); its path and gcc's seconds."""
    lib = scratch / "libnvtx_capture.so"
    if lib.is_file():
        return lib, 0.0
    include = _nvtx_include()
    if include is None:
        raise RuntimeError("no nvtx3/nvToolsExt.h (CUDA's include/ or the nvidia-nvtx wheel)")
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    tmp = lib.with_suffix(".tmp.so")
    t0 = time.perf_counter()
    subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-I{include}", str(CAPTURE_C), "-o", str(tmp)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    tmp.replace(lib)
    return lib, time.perf_counter() - t0


def analyse(events: list[str]) -> dict:
    """Balance and nesting of a capture (`push <name>` / `pop` lines, one stream)."""
    depth, lowest, closed_early, names = 0, 0, False, Counter()
    for i, line in enumerate(events):
        if line.startswith("push "):
            depth += 1
            names[line[5:]] += 1
        elif line == "pop":
            depth -= 1
            lowest = min(lowest, depth)
            if depth == 0 and i != len(events) - 1:
                closed_early = True  # the outermost range closed before the end
    pushes = sum(names.values())
    return {"pushes": pushes, "pops": len(events) - pushes, "final_depth": depth,
            "lowest_depth": lowest, "outer_closed_early": closed_early, "names": dict(names)}  # fmt: skip


def nvtx(ctx: Ctx, report: Report) -> None:
    lib, _ = build_capture_lib(ctx.scratch)
    capture = ctx.scratch / "nvtx_capture.txt"
    capture.unlink(missing_ok=True)
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(lib), MINISPEED_NVTX_CAPTURE=str(capture))
    script = STEP.format(scripts=str(REPO / "scripts"))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        raise RuntimeError(
            f"the traced step failed (exit {proc.returncode}): {proc.stderr[-1500:]}"
        )
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    report.facts["child"] = child
    report.info("ranges pushed through", child["binding"] or "?", note=f"on {ctx.device.type}")
    if not child["enabled"]:
        report.fail("NVTX on in the traced step", child["binding"])
        return
    if not capture.exists():
        report.fail("capture file written", "the tool was not loaded (no capture file)")
        return
    events = capture.read_text().splitlines()
    if events[:2] == ["push minispeed.probe", "pop"]:  # torch's binding is probed once first
        events = events[2:]
    a = analyse(events)
    report.facts["capture"] = a
    report.check("pushes minus pops", abs(a["pushes"] - a["pops"]), 0, unit="",
                 note=f"{a['pushes']} pushes")  # fmt: skip
    report.check("depth below zero", -a["lowest_depth"], 0, unit="")
    # zero.shard's own ranges (the stage-3 set-up gather) come before the step: balanced on
    # their own; from the step's push on, the depth first returns to zero at the last event
    start = events.index("push check.step") if "push check.step" in events else len(events)
    before, step = analyse(events[:start]), analyse(events[start:])
    nested = bool(step["pushes"]) and not step["outer_closed_early"] and before["final_depth"] == 0
    report.check("ranges of the step outside check.step", 0 if nested else 1, 0, unit="",
                 note=f"{before['pushes']} set-up ranges before it")  # fmt: skip
    wanted = ["check.step", "model", "zero.backward", "zero.step"]
    missing = [w for w in wanted if w not in a["names"]]
    report.check("expected ranges missing", len(missing), 0, unit="",
                 note=", ".join(missing) if missing else f"{len(a['names'])} distinct names")  # fmt: skip
    if not ctx.gpu:
        report.skip("the same on CUDA")
