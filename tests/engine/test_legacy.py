"""Megatron-DeepSpeed's legacy sections DeepSpeed 0.19.8 removed, kept with DeepSpeed 0.17.6's
meaning (minispeed.engine.legacy), against scripts/record_ds_legacy.py's record on 0.17.6.

- `progressive_layer_drop`: the forward's `progressive_layer_drop=True, pld_theta=` in training
  mode, `engine.get_pld_theta()` per step, and the losses of a model that scales its layers by
  theta, on 2 ranks with gradient accumulation.
- `curriculum_learning` (`seqlen`), for `fixed_linear`, `fixed_root`, `fixed_discrete` and
  `custom` (its function given to `engine.curriculum_scheduler_legacy`): the
  forward's `curriculum_seqlen=` per micro-step and the losses of a model that truncates.
- `elasticity`: `compute_elastic_config`'s answers for a table of sections and world sizes (its
  error conditions by class, each naming the key), and the engine's batch triple at 2 ranks.
- What is left refused: another `curriculum_type`, a section missing a key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

import minispeed.engine.elastic as elastic
from minispeed.core.config import ConfigError
from minispeed.core.testing import run_distributed
from minispeed.engine.config import EngineConfig

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_legacy.json"


IMPORTS = {
    **ds_scripts.PLAIN_IMPORTS,
    "from deepspeed.elasticity import compute_elastic_config\n": (
        "from minispeed.engine.elasticity import compute_elastic_config\n"
    ),
}


def _script():
    return ds_scripts.load("record_ds_legacy.py", IMPORTS)


def _run(rank: int, world_size: int) -> list:
    return _script().main()


def _same_error(ours: dict, ref: dict) -> bool:
    """Ours is DeepSpeed's error class or a subclass of it (ours are `ConfigError`s, so
    DeepSpeed's bare ValueError is matched by any of them)."""
    classes = {**vars(elastic), "ValueError": ValueError}
    return issubclass(classes[ours["error"]], classes[ref["error"]])


def test_legacy_sections_train_as_on_deepspeed_0_17_6() -> None:
    recorded = json.loads(FIXTURE.read_text())
    assert recorded["deepspeed"] == "0.17.6"
    runs = run_distributed(_run, world_size=2, timeout_s=240)
    for ours, ref in zip(runs, recorded["ranks"], strict=True):
        # The elastic answers' errors by class (below); every other value as recorded.
        for part in (ours[-2]["answers"], ours[-1]["answers"]):
            for name, answer in part.items():
                if "error" in answer:
                    refs = {**ref[-2]["answers"], **ref[-1]["answers"]}
                    assert _same_error(answer, refs[name]), (name, answer, refs[name])
                    part[name] = refs[name]
        ds_scripts.assert_matches(ours, ref)
    pld = runs[0][0]
    assert pld["forward_kwargs"][-1]["pld_theta"] < 1.0  # the schedule decayed
    assert pld["eval_kwargs"] == {}  # nothing added in eval mode
    lengths = [k["curriculum_seqlen"] for k in runs[0][1]["forward_kwargs"]]
    assert lengths == [4, 4, 8, 8, 8, 8, 12, 12, 12, 12]
    # At 2 ranks the elastic section gives a batch of 24 as 3 per rank x 4 micro-steps.
    assert runs[0][-1]["answers"]["adopted"] == [24, 3, 4]


def test_elastic_errors_name_the_key() -> None:
    """Each error condition of `compute_elastic_config` (DeepSpeed's classes, recorded) names
    the key to change, where DeepSpeed's messages sometimes name none."""
    script = _script()
    for _name, ds_config, kwargs, key in script.ELASTIC_CASES:
        if key is None:
            continue
        with pytest.raises(elastic.ElasticityError, match=key):
            script.compute_elastic_config(
                ds_config, **{"target_deepspeed_version": "0.17.6", **kwargs}
            )


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, "progressive_layer_drop.gamma"),
        ({"progressive_layer_drop": {"enabled": True, "theta": 0.0, "gamma": 0.1}},
         "progressive_layer_drop.theta"),
        ({"curriculum_learning": {"enabled": True, "curriculum_type": "vocab",
                                  "min_difficulty": 4, "max_difficulty": 8,
                                  "schedule_type": "fixed_discrete"}},
         "curriculum_learning.curriculum_type"),
        ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen",
                                  "min_difficulty": 4, "max_difficulty": 8,
                                  "schedule_type": "fixed_linear"}},
         "curriculum_learning.schedule_config"),
    ],
)  # fmt: skip
def test_legacy_section_missing_or_wrong_key_is_named(section: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        EngineConfig.from_ds_config({"train_batch_size": 8, **section})


def _on_pipeline(rank: int, world_size: int) -> str:
    from torch import nn

    import minispeed.engine as deepspeed
    from minispeed.engine.pipe import LayerSpec, PipelineModule

    model = PipelineModule(
        [LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2)], num_stages=2, loss_fn=nn.MSELoss()
    )
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {}},
              "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.1}}  # fmt: skip
    with pytest.raises(ConfigError) as e:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return str(e.value)


def test_forward_arguments_on_a_pipeline_are_refused_on_every_rank() -> None:
    """A pipeline's stages take no extra forward arguments (0.17.6's pipeline engine passes
    none): refused at set-up, naming the section, on both ranks."""
    for message in run_distributed(_on_pipeline, world_size=2, timeout_s=120):
        assert message.startswith("progressive_layer_drop: ") and "pipeline" in message
