"""Run a DeepSpeed script kept under scripts/ with only its import lines changed to minispeed's.

`load(path, {old_line: new_line})` executes the script's source with each `old_line` replaced
(each must occur exactly once: a script that drifts from its recorded form fails loudly) under a
module name that is not `__main__`, so its recording block does not run; the test then calls
its `main()`. Until `minispeed.engine` exports `initialize` / `init_distributed` (the lead's
part of issue 20), `engine_namespace()` stands in for them with the pipeline engine; it uses the
real ones as soon as they exist.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import minispeed.engine

ROOT = Path(__file__).resolve().parents[2]

PIPE_IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec\n": (
        "from minispeed.engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec\n"
    ),
}

MOE_IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.moe.layer import MoE\n": "from minispeed.engine.moe.layer import MoE\n",
    "from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer\n": (
        "from minispeed.engine.moe.utils import split_params_into_different_moe_groups_for_optimizer\n"
    ),
}


def load(script: str, imports: dict[str, str]) -> types.ModuleType:
    """The script `scripts/<script>` with its imports swapped, executed as a module."""
    path = ROOT / "scripts" / script
    source = path.read_text()
    for old, new in imports.items():
        count = source.count(old)
        assert count == 1, f"{script}: expected the line {old!r} once, found it {count} times"
        source = source.replace(old, new)
    module = types.ModuleType(f"ds_script_{path.stem}")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)
    module.deepspeed = engine_namespace()
    return module


def _init_distributed(dist_backend: str | None = None, **_: Any) -> None:
    import minispeed.comm as comm

    if not comm.is_initialized():
        comm.init_distributed(backend=dist_backend or "gloo")


def _initialize(
    model: Any = None, optimizer: Any = None, config: Any = None, lr_scheduler: Any = None, **_: Any
) -> tuple:
    from minispeed.engine.pipe import PipelineModule
    from minispeed.engine.pipe_engine import PipelineEngine

    assert isinstance(model, PipelineModule), "the stand-in initialize() takes pipelines only"
    engine = PipelineEngine(model, optimizer, config, lr_scheduler)
    return engine, optimizer, None, lr_scheduler


def engine_namespace() -> types.SimpleNamespace:
    """`minispeed.engine`'s names, with stand-ins for the two it does not have yet."""
    names = {
        k: getattr(minispeed.engine, k) for k in dir(minispeed.engine) if not k.startswith("__")
    }
    names.setdefault("init_distributed", _init_distributed)
    names.setdefault("initialize", _initialize)
    return types.SimpleNamespace(**names)
