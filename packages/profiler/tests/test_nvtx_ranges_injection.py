"""NVTX ranges really reach an NVTX tool, without a GPU: a tiny injection library (the way
Nsight Systems attaches) records every push and pop of a profiled step run in a subprocess."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import minispeed.profiler

CAPTURE_C = Path(minispeed.profiler.__file__).parent / "csrc" / "nvtx_capture" / "nvtx_capture.c"
NVTX_INCLUDE_DIRS = [
    Path("/usr/local/cuda/include"),
    Path(os.environ.get("CUDA_HOME", "/x")) / "include",
]


@pytest.fixture(scope="module")
def capture_lib(tmp_path_factory):
    include = next((d for d in NVTX_INCLUDE_DIRS if (d / "nvtx3" / "nvToolsExt.h").exists()), None)
    if include is None:
        pytest.skip("no NVTX v3 headers (nvtx3/nvToolsExt.h ships with CUDA under include/)")
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found: cannot build the NVTX capture library")
    pytest.importorskip("nvtx", reason="the nvtx package (a minispeed-core dependency) is absent")
    lib = tmp_path_factory.mktemp("nvtx") / "libnvtx_capture.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", f"-I{include}", str(CAPTURE_C), "-o", str(lib)],
        check=True,
    )
    return lib


STEP = textwrap.dedent(
    """
    import torch
    from torch import nn
    from minispeed import profiler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))

    @profiler.range("test.loss")
    def loss_of(y):
        return y.square().mean()

    assert profiler.nvtx_enabled()
    with profiler.range("test.step"):
        with profiler.module_ranges(model, depth=1):
            loss = loss_of(model(torch.randn(3, 4)))
            with profiler.range("test.backward"):
                loss.backward()
    """
)


def test_a_profiled_step_pushes_and_pops_nested_named_ranges(capture_lib, tmp_path):
    out = tmp_path / "capture.txt"
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(capture_lib), MINISPEED_NVTX_CAPTURE=str(out))
    subprocess.run([sys.executable, "-c", STEP], env=env, check=True, timeout=120)
    events = out.read_text().splitlines()
    assert events == [
        "push test.step",
        "push model",
        "push model.0",
        "pop",
        "push model.1",
        "pop",
        "push model.2",  # depth 1: the inner Linear (model.2.0) gets no range
        "pop",
        "pop",
        "push test.loss",
        "pop",
        "push test.backward",
        "pop",
        "pop",
    ]
