"""The machine, every op's build, and which checks cover which CUDA kernel.

- `env`: the GPU (name, compute capability, memory, multiprocessors), torch and its CUDA, nvcc,
  the driver, transformers, the NVTX binding, how minispeed was found.
- `build`: every op of every package, each JIT-built by its own `OpBuilder` in its own process,
  all at once (the device has 16 cores); per op the wall time, whether it was built or found
  cached, and the nvcc flags it got (they must name the GPU's `sm_XY`). Also the two libraries
  the checks build themselves: the block-sparse attention kernels (`sparse_cuda.py`) and the
  NVTX capture tool (`check_nvtx.py`).
- `coverage`: every `__global__` kernel in every `.cu` file of the repository must be claimed by
  a check in `KERNEL_CHECKS`, and every op the registry knows must be in `BUILDERS`; a new
  kernel or op without a check fails here until it gets one.

Dry run: nothing of the ops compiles (set `GPU_CHECK_DRY_BUILD=1` to build the CPU ops and the
sparse-attention library anyway, to try the build step on a machine without a GPU).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpucheck import spec_of
from gpucheck.harness import NO_GPU, REPO, Ctx, Report

# Every op builder of every package: (op name, module, class). The registry finds them through
# entry points, which an uninstalled checkout (src/ on PYTHONPATH, as on the device) lacks.
BUILDERS = (
    ("cast", "minispeed.core.ops.cast", "CastBuilder"),
    ("cast_cuda", "minispeed.core.ops.cast", "CastCudaBuilder"),
    ("comm_compression", "minispeed.comm.compression.ops", "CompressionBuilder"),
    ("comm_compression_cuda", "minispeed.comm.compression.ops", "CompressionCudaBuilder"),
    ("moe_permute", "minispeed.moe.permute", "PermuteBuilder"),
    ("moe_permute_cuda", "minispeed.moe.permute", "PermuteCudaBuilder"),
    ("inference_kernels", "minispeed.inference.kernels", "InferenceKernelsBuilder"),
    ("inference_kernels_cuda", "minispeed.inference.kernels", "InferenceCudaKernelsBuilder"),
    ("offload", "minispeed.offload.ops", "OffloadBuilder"),
)

# Every CUDA kernel in the repository and the check that runs it against its reference.
KERNEL_CHECKS = {
    "convert_kernel": "op.cast",
    "sign_bits_kernel": "op.compression",
    "sign_scales_kernel": "op.compression",
    "sign_unpack_kernel": "op.compression",
    "quantize_kernel": "op.compression",
    "dequantize_kernel": "op.compression",
    "sparse_accumulate_kernel": "op.compression",
    "gather_rows_kernel": "op.moe_permute",
    "combine_rows_kernel": "op.moe_permute",
    "norm_kernel": "op.inference",
    "bias_gelu_kernel": "op.inference",
    "masked_softmax_kernel": "op.inference",
    "rotary_kernel": "op.inference",
    "decode_attention_kernel": "op.inference",
    "int8_linear_kernel": "op.inference",
    "sparse_forward_kernel": "op.sparse_attention",
    "sparse_backward_kernel": "op.sparse_attention",
}

_KERNEL = re.compile(r"__global__\s+void\s+(\w+)")
DRY_BUILD_ENV = "GPU_CHECK_DRY_BUILD"


def env(ctx: Ctx, report: Report) -> None:
    import torch

    from minispeed.core.op_builder import toolchain

    facts = report.facts
    facts["torch"] = torch.__version__
    facts["cuda"] = str(torch.version.cuda)
    facts["python"] = sys.version.split()[0]
    facts["nvcc"] = toolchain.nvcc_version()
    facts["cxx"] = toolchain.cxx_compiler()
    facts["ninja"] = toolchain.find_ninja()
    facts["cpu_count"] = os.cpu_count()
    facts["load_avg"] = os.getloadavg()[0]
    import minispeed.core

    facts["minispeed_core"] = str(Path(minispeed.core.__file__).parent)
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:
        facts["transformers"] = None
    try:
        import nvtx  # noqa: F401

        facts["nvtx_binding"] = "nvtx package"
    except ImportError:
        facts["nvtx_binding"] = "torch.cuda.nvtx (the nvtx package is absent)"
    report.info("torch", facts["torch"], note=f"CUDA {facts['cuda']}")
    report.info("nvcc", str(facts["nvcc"]), note=f"cxx {facts['cxx']}")
    report.info("CPU cores, load average", f"{facts['cpu_count']}, {facts['load_avg']:.2f}")
    if not ctx.gpu:
        facts["device"] = "cpu"
        report.skip("GPU")
        return
    props = torch.cuda.get_device_properties(ctx.device)
    facts.update(
        device=props.name,
        capability=f"{props.major}.{props.minor}",
        multiprocessors=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
        torch_cuda_arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST"),
    )
    report.info(
        "GPU", props.name, note=f"sm_{props.major}{props.minor}, {props.multi_processor_count} SMs"
    )
    report.info("GPU memory", props.total_memory / 2**30, "GiB")
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version,clocks.sm,clocks.mem,power.limit",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
        facts["nvidia_smi"] = out
        report.info("driver, SM clock, mem clock, power limit", out)
    if (
        facts["nvcc"]
        and facts["cuda"]
        and facts["nvcc"].split(".")[0] != facts["cuda"].split(".")[0]
    ):
        report.finding(
            f"nvcc {facts['nvcc']} and torch's CUDA {facts['cuda']} differ in the major version: "
            "torch's JIT refuses to build the CUDA ops"
        )


def _run_group(cmd: list[str], env: dict[str, str], timeout_s: float):
    """`cmd` in its own process group: `(returncode, stdout, stderr)`, or `None` after killing
    the whole group (the compilers it started too) at `timeout_s`."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return proc.returncode, out, err


def _build_one(op: str, module: str, cls: str, env: dict[str, str], timeout_s: float) -> dict:
    """Build (or load from the cache) one op in a fresh process; what happened, as a dict."""
    code = (
        "import json, sys\n"
        f"from {module} import {cls}\n"
        f"b = {cls}()\n"
        "ok, why = b.is_compatible()\n"
        "if not ok:\n"
        "    print(json.dumps({'incompatible': why})); sys.exit(0)\n"
        "b.load()\n"
        "r = b.last_load\n"
        "marker = json.loads((r.cache_dir / 'minispeed_build.json').read_text())\n"
        "print(json.dumps({'built': r.built, 'seconds': r.seconds, "
        "'nvcc_flags': marker.get('nvcc_flags', []), 'cache_dir': str(r.cache_dir)}))\n"
    )
    t0 = time.perf_counter()
    done = _run_group([sys.executable, "-c", code], env, timeout_s)
    wall = time.perf_counter() - t0
    if done is None:
        return {"error": f"not built within {timeout_s:.0f} s (killed)", "wall": wall}
    rc, out, err = done
    sys.stderr.write(f"--- build {op} (exit {rc}, {wall:.1f} s)\n{err[-4000:]}")
    if rc != 0:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "OpBuildError" in ln or "op '" in ln), None)
        return {"error": reason or (lines[-1] if lines else f"exit {rc}"), "wall": wall}
    result = json.loads(out.strip().splitlines()[-1])
    result["wall"] = wall
    return result


def build(ctx: Ctx, report: Report) -> None:
    from gpucheck import check_nvtx, sparse_cuda

    dry_build = os.environ.get(DRY_BUILD_ENV, "") not in ("", "0")
    # every build ends (or is killed) inside the check's budget, so each op gets its own row
    spec = spec_of("build")
    timeout_s = (spec.dry_budget_s if ctx.dry_run else spec.budget_s) - 30
    env_vars = dict(os.environ)
    env_vars.pop("MINISPEED_DISABLE_OPS", None)
    jobs: dict[str, object] = {}
    with ThreadPoolExecutor(max_workers=len(BUILDERS) + 2) as pool:
        for op, module, cls in BUILDERS:
            if op.endswith("_cuda") and not ctx.gpu:
                continue
            if ctx.dry_run and not dry_build:
                continue
            jobs[op] = pool.submit(_build_one, op, module, cls, env_vars, timeout_s)
        arch = None
        if ctx.gpu:
            import torch

            major, minor = torch.cuda.get_device_capability(ctx.device)
            arch = f"{major}{minor}"
        if arch or dry_build:  # dry: compile for sm_90, to try the command
            jobs["sparse_attention (ctypes library)"] = pool.submit(
                sparse_cuda.build_library, ctx.scratch, arch or "90"
            )
        jobs["nvtx capture tool"] = pool.submit(check_nvtx.build_capture_lib, ctx.scratch)
    for op, _, _ in BUILDERS:
        if op not in jobs:
            why = NO_GPU if op.endswith("_cuda") and not ctx.gpu else (
                "skipped: the dry run builds nothing (MINISPEED_DISABLE_OPS=all; "
                f"{DRY_BUILD_ENV}=1 builds the CPU ops)"
            )  # fmt: skip
            report.skip(f"op {op}", why)
            continue
        res = jobs[op].result()
        report.facts[op] = res
        if "incompatible" in res:
            report.fail(f"op {op} builds", res["incompatible"])
        elif "error" in res:
            report.fail(f"op {op} builds", res["error"][:300])
        else:
            how = "built" if res["built"] else "cached"
            flags = " ".join(f for f in res["nvcc_flags"] if "arch" in f)
            report.info(f"op {op} ({how})", res["seconds"], "s", note=flags)
            if arch is not None and op.endswith("_cuda"):
                has_arch = f"sm_{arch}" in " ".join(res["nvcc_flags"])
                report.check(f"op {op}: nvcc flags name sm_{arch}", 0.0 if has_arch else 1.0, 0,
                             unit="")  # fmt: skip
    for name in ("sparse_attention (ctypes library)", "nvtx capture tool"):
        if name not in jobs:
            report.skip(name, NO_GPU + "; the nvcc compile test covers this source for sm_90")
            continue
        try:
            path, seconds = jobs[name].result()
            report.info(name, seconds, "s", note=Path(path).name)
        except Exception as err:
            report.fail(f"{name} builds", str(err)[:300])


def coverage(ctx: Ctx, report: Report) -> None:
    sources = sorted(REPO.glob("packages/*/src/minispeed/*/csrc/**/*.cu"))
    seen: set[str] = set()
    for path in sources:
        kernels = _KERNEL.findall(path.read_text())
        seen.update(kernels)
        missing = [k for k in kernels if k not in KERNEL_CHECKS]
        checks = sorted({KERNEL_CHECKS[k] for k in kernels if k in KERNEL_CHECKS})
        report.check(
            f"{path.name}: {len(kernels)} kernels without a check",
            len(missing),
            0,
            unit="",
            note=f"checked by {', '.join(checks)}" + (f"; unchecked: {missing}" if missing else ""),
        )
    stale = sorted(set(KERNEL_CHECKS) - seen)
    if stale:
        report.check("kernels listed but no longer in any .cu", len(stale), 0, unit="",
                     note=", ".join(stale))  # fmt: skip
    from minispeed.core.op_builder import discover_builders

    registered = set(discover_builders().builders)
    if len(registered) > 2:  # installed with entry points (not src/ on the path)
        unbuilt = sorted(registered - {op for op, _, _ in BUILDERS})
        report.check("registered ops the check does not build", len(unbuilt), 0, unit="",
                     note=", ".join(unbuilt))  # fmt: skip
    else:
        report.skip("registered ops", "entry points absent (src/ on PYTHONPATH): list not checked")
