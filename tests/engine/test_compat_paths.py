"""The `deepspeed` distribution (packages/deepspeed_compat): what transformers and accelerate look
for, the table of DeepSpeed's paths it is generated from, and that it never stands in for
DeepSpeed where DeepSpeed's reference values are recorded.

- the distribution is named `deepspeed`, versioned `0.19.8+minispeed.<minispeed's version>`,
  and transformers' and accelerate's `is_deepspeed_available()` say yes;
- its tree is exactly what `scripts/sync_deepspeed_compat.py` generates from
  `minispeed.engine.deepspeed_paths` (no drift either way);
- every adapter path imports and resolves as an attribute from `deepspeed`, and its names are
  the engine module's very objects (class identity; no engine module loaded a second time under
  a `deepspeed` name); every refused path raises an `ImportError` naming what to use, and so
  does a from-import of a name an adapter lacks (naming the module, the name and the migration
  page), while `hasattr` still answers False;
- every public module of DeepSpeed 0.19.8 (`fixtures/ds_modules.json`, recorded by
  `scripts/record_ds_modules.py`) imports as an adapter, or raises an `ImportError` naming it
  (or the refused package it lies in) and what to use instead;
- `scripts/ds_fixture.py` and a recorder refuse to run against it, and no kept fixture says it
  was recorded on it.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from importlib.metadata import metadata, version
from pathlib import Path

import pytest

import minispeed.engine as engine
from minispeed.engine.deepspeed_paths import ADAPTERS, HINTS, REFUSED, why

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = json.loads((ROOT / "tests/engine/fixtures/ds_modules.json").read_text())
REPLACEMENT = ("use ", "set ", "minispeed", "train ", "feed ", "call ")
sys.path.insert(0, str(ROOT / "scripts"))
import sync_deepspeed_compat  # noqa: E402


def test_distribution_is_deepspeed_by_name_and_minispeed_by_version() -> None:
    import deepspeed
    from accelerate.utils import is_deepspeed_available as accelerate_sees
    from transformers.integrations.deepspeed import is_deepspeed_available as transformers_sees

    expected = f"0.19.8+minispeed.{version('minispeed')}"
    assert version("deepspeed") == expected == deepspeed.__version__
    assert deepspeed.git_version_info.version == expected
    assert metadata("deepspeed")["Name"] == "deepspeed"
    assert transformers_sees() and accelerate_sees()


def test_tree_is_the_table() -> None:
    assert sync_deepspeed_compat.differences() == []


@pytest.mark.parametrize("path", sorted(ADAPTERS))
def test_adapter_path_is_the_engine_module(path: str) -> None:
    import deepspeed

    module = importlib.import_module(path)
    by_attribute = deepspeed
    for part in path.split(".")[1:]:
        by_attribute = getattr(by_attribute, part)
    if by_attribute is not module:  # as in DeepSpeed, a function named as its module wins
        parent, _, name = path.rpartition(".")
        assert by_attribute is getattr(importlib.import_module(ADAPTERS[parent]), name), path
    target = importlib.import_module(ADAPTERS[path])
    for name in target.__all__:
        ours, theirs = getattr(module, name), getattr(target, name)
        if isinstance(theirs, type(engine)):  # a child module: its deepspeed counterpart
            assert ours.__name__ == f"{path}.{name}", (path, name)
        else:
            assert ours is theirs, (path, name)


def test_classes_keep_their_identity_and_no_module_loads_twice() -> None:
    import deepspeed
    import deepspeed.runtime.engine
    import deepspeed.runtime.zero.partition_parameters as pp

    assert deepspeed.runtime.engine.DeepSpeedEngine is engine.DeepSpeedEngine
    assert deepspeed.zero.Init is engine.zero.Init is pp.Init
    assert deepspeed.runtime.zero.GatheredParameters is engine.zero.GatheredParameters
    assert deepspeed.initialize is engine.initialize
    assert pp._orig_torch_arange is engine.runtime.zero.partition_parameters._orig_torch_arange
    src = Path(engine.__file__).parent
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).is_relative_to(src):
            assert name.startswith("minispeed.engine"), (name, file)


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_refused_path_names_what_to_use(path: str) -> None:
    with pytest.raises(ImportError, match="is not provided by minispeed") as err:
        importlib.import_module(path)
    assert path in str(err.value) and REFUSED[path] in str(err.value)
    assert any(w in REFUSED[path] for w in REPLACEMENT), path


def test_every_public_deepspeed_module_imports_or_names_what_to_use() -> None:
    """A script written against DeepSpeed 0.19.8 may import any of its public modules: each
    one is an adapter, or its import raises an `ImportError` that names it (or the refused
    package it lies in, saying so) and what to use instead; never a bare "No module named"."""
    assert PUBLIC["deepspeed"] == "0.19.8" and len(PUBLIC["modules"]) > 200
    wrong = []
    for path in PUBLIC["modules"]:
        try:
            importlib.import_module(path)
        except ImportError as err:
            message, refused = str(err), err.name or ""
            inside = path.startswith(refused + ".") and "nor is any module below it" in message
            if not (
                (refused == path or inside)
                and message.startswith(f"{refused} is not provided by minispeed")
                and message.endswith(why(refused))
                and any(w in why(refused) for w in REPLACEMENT)
            ):
                wrong.append(f"{path}: {message}")
        else:
            if path not in ADAPTERS:
                wrong.append(f"{path}: imports, but is no adapter of the table")
    assert not wrong, "\n".join(wrong)
    page = (ROOT / "docs/engine/deepspeed-compat.md").read_text()
    for prefix in HINTS:  # a hint for a path DeepSpeed does not have helps no one
        assert prefix in PUBLIC["modules"], prefix
        assert f"`{prefix.removeprefix('deepspeed.')}`" in page, f"{prefix}: not on the docs page"


def test_recording_against_minispeed_is_refused() -> None:
    """A recorder's own run fails before anything is recorded (it imports `ds_fixture` first,
    which refuses this `deepspeed`): a fixture recorded on minispeed would compare minispeed
    with itself."""
    recorder = subprocess.run(
        [sys.executable, "scripts/record_ds_estimates.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert recorder.returncode != 0 and "is minispeed" in recorder.stderr, recorder.stderr[-2000:]
    assert "record fixtures with DeepSpeed's own venv" in recorder.stderr


def test_no_fixture_was_recorded_on_minispeed() -> None:
    fixtures = [*ROOT.glob("tests/**/fixtures/*.json"), *ROOT.glob("packages/*/tests/**/*.json")]
    assert len(fixtures) > 15
    for path in fixtures:
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            recorded = str(data.get("deepspeed", "")) + str(data.get("recorded_with", ""))
            assert "+minispeed" not in recorded, path


def test_a_name_an_adapter_lacks_is_refused_naming_module_name_and_page() -> None:
    """`from deepspeed.runtime.zero.stage3 import Name` where minispeed has no `Name`: the
    ImportError names the module, the name and where to look, not Python's bare "cannot import
    name"; `hasattr` and `getattr(..., default)` still answer as for any missing attribute."""
    import deepspeed.runtime.zero.stage3 as stage3

    for module in ("deepspeed", "deepspeed.runtime.zero", "deepspeed.runtime.zero.stage3"):
        with pytest.raises(ImportError) as err:
            exec(f"from {module} import SomethingWeDontHave", {})
        assert re.fullmatch(
            rf"{re.escape(module)}\.SomethingWeDontHave is not provided by minispeed \(.*, which "
            r"has no 'SomethingWeDontHave'\); see docs/engine/migration.md for what to use instead",
            str(err.value),
        ), str(err.value)
    assert not hasattr(stage3, "SomethingWeDontHave")
    assert getattr(stage3, "SomethingWeDontHave", None) is None
    with pytest.raises(AttributeError, match=r"not provided by minispeed.*migration\.md"):
        stage3.SomethingWeDontHave  # noqa: B018


@pytest.mark.parametrize("name", ["safe_set_local_fp32_param"])
def test_refused_utils_names_say_what_to_use(name: str) -> None:
    """A name an engine module declines says why under `from ... import`, and is a plain missing
    attribute to `hasattr` and `getattr(..., default)`, which libraries use to probe DeepSpeed's
    features (an ImportError would escape them)."""
    import importlib

    for module in ("deepspeed.utils", "minispeed.engine.utils"):
        with pytest.raises(
            ImportError, match=r"not provided by minispeed.*safe_set_full_fp32_param"
        ):
            exec(f"from {module} import {name}", {})
        imported = importlib.import_module(module)
        assert not hasattr(imported, name)
        assert getattr(imported, name, None) is None
        with pytest.raises(AttributeError, match=r"not provided by minispeed.*safe_set_full"):
            getattr(imported, name)


def test_declined_moe_names_are_missing_attributes_with_their_reason() -> None:
    import deepspeed.moe.sharded_moe as sharded_moe

    assert getattr(sharded_moe, "TopKGate", None) is None
    with pytest.raises(ImportError, match=r"sharded_moe\.MOELayer is not provided.*layer\.MoE"):
        exec("from deepspeed.moe.sharded_moe import MOELayer", {})


def test_zero3_template_is_accepted_once_the_trainer_fills_it() -> None:
    """examples/hf_zero3_offload_template.json (docs/engine/trainer-tutorial.md), filled
    by transformers' own code as the Trainer fills it, is a config the engine accepts whole."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import (
        HfTrainerDeepSpeedConfig,
        unset_hf_deepspeed_config,
    )

    from minispeed.engine.config import EngineConfig

    args = SimpleNamespace(
        world_size=2, per_device_train_batch_size=2, gradient_accumulation_steps=4,
        max_grad_norm=1.0, learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, weight_decay=0.01, save_on_each_node=False, fp16=False,
        fp16_full_eval=False, bf16=False, bf16_full_eval=False,
        get_warmup_steps=lambda total: 10,
    )  # fmt: skip
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=768))
    try:
        hf = HfTrainerDeepSpeedConfig(str(ROOT / "examples/hf_zero3_offload_template.json"))
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, model, num_training_steps=100)
        config = EngineConfig.from_ds_config(hf.config, data_parallel_size=2)
    finally:
        unset_hf_deepspeed_config()  # transformers keeps it globally: ZeRO-3 for every model
    assert config.train_batch_size == 16 and config.zero.stage == 3
    assert config.zero.offload_param.device == "cpu" == config.zero.offload_optimizer.device
