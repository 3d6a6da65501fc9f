"""Run a DeepSpeed script kept under scripts/ with only its import lines changed to minispeed's.

`load(path, {old_line: new_line})` executes the script's source with each `old_line` replaced
(each must occur exactly once: a script that drifts from its recorded form fails loudly) under a
module name that is not `__main__`, so its recording block does not run; the test then calls
its `main()`.
"""

from __future__ import annotations

import types
from pathlib import Path

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
    return module
