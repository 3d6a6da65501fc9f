"""One checkpoint directory for a pipeline × data grid: every stage's files side by side (named
by stage and data rank), a round trip that continues training identically, loading at another
data-parallel size, and a checkpoint of another pipeline shape refused naming both grids."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from minispeed.core.testing import run_distributed

GAS, MICRO, WIDTH, LAYERS = 2, 3, 6, 4


def _data(replica: int, steps: int):
    g = torch.Generator().manual_seed(10 + replica)
    return [
        (torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g))
        for _ in range(steps * GAS)
    ]


def _engine(zero_stage: int, stages: int, config_extra: dict | None = None):
    import minispeed.engine as deepspeed
    import minispeed.engine.pipe as pipe

    model = pipe.PipelineModule(
        [pipe.LayerSpec(nn.Linear, WIDTH, WIDTH) for _ in range(LAYERS)],
        num_stages=stages,
        loss_fn=nn.functional.mse_loss,
        seed_layers=True,
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": zero_stage},
        **(config_extra or {}),
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        config=config,
    )
    return engine


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _save_and_go_on(rank, world_size, zero_stage, path, async_save=False):
    from minispeed.engine.checkpoint.background import checkpointer_of

    engine = _engine(zero_stage, stages=2, config_extra={"checkpoint": {"async_save": async_save}})
    data = _data(engine.grid.rank_in("data"), 4)
    for step in range(2):
        engine.train_batch(iter(data[step * GAS : (step + 1) * GAS]))
    engine.save_checkpoint(path, client_state={"epoch": 3})
    saved, lr = _params(engine), engine.get_lr()
    after = [float(engine.train_batch(iter(data[s * GAS : (s + 1) * GAS]))) for s in (2, 3)]
    checkpointer_of(engine).wait()  # async: training went on while it was written
    return {"stage": engine.stage_id, "params": saved, "after": after, "lr": lr}


def _load_and_go_on(rank, world_size, zero_stage, path, go_on: bool):
    engine = _engine(zero_stage, stages=2)
    where, client = engine.load_checkpoint(path)
    out = {"stage": engine.stage_id, "params": _params(engine), "where": where, "client": client}
    out["steps"], out["lr"] = engine.global_steps, engine.get_lr()
    if go_on:
        data = _data(engine.grid.rank_in("data"), 4)
        out["after"] = [
            float(engine.train_batch(iter(data[s * GAS : (s + 1) * GAS]))) for s in (2, 3)
        ]
    return out


@pytest.mark.parametrize(
    ("zero_stage", "async_save"), [(0, False), (1, False), (0, True), (1, True)]
)
def test_pipe_by_data_saves_one_directory_and_resumes_identically(
    tmp_path, zero_stage, async_save
) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(
        _save_and_go_on, world_size=4, args=(zero_stage, path, async_save), timeout_s=180
    )
    tag = tmp_path / "ckpt" / "global_step2"
    files = sorted(
        os.path.relpath(os.path.join(d, f), tag) for d, _, fs in os.walk(tag) for f in fs
    )
    # every stage's zero files, named by stage (directory) and data rank: a pipeline's engine is
    # the same engine as any model's, with ZeRO's optimizer (stage 0 when the config asks none)
    for stage in range(2):
        for data_rank in range(2):
            assert f"pipe{stage:02d}-of-02/weights.rank{data_rank:05d}-of-00002.pt" in files
        assert f"pipe{stage:02d}-of-02/metadata.json" in files
    assert not [f for f in files if f.endswith("model_states.pt")]
    assert "grid.json" in files and (tmp_path / "ckpt" / "latest").read_text() == "global_step2\n"

    loaded = run_distributed(
        _load_and_go_on, world_size=4, args=(zero_stage, path, True), timeout_s=180
    )
    for before, after in zip(saved, loaded, strict=True):
        assert before["stage"] == after["stage"]
        torch.testing.assert_close(after["params"], before["params"], rtol=0, atol=0)
        assert after["after"] == before["after"]  # weights, moments and scheduler all restored
        assert after["client"] == {"epoch": 3} and after["steps"] == 2
        # DeepSpeed's path: the stage's model-states file (model-parallel rank = stage) in the tag
        stage = after["stage"]
        assert after["where"] == f"{path}/global_step2/mp_rank_{stage:02d}_model_states.pt"


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_pipe_checkpoint_loads_at_another_data_parallel_size(tmp_path, zero_stage) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save_and_go_on, world_size=4, args=(zero_stage, path), timeout_s=180)
    loaded = run_distributed(
        _load_and_go_on, world_size=2, args=(zero_stage, path, False), timeout_s=180
    )
    by_stage = {s["stage"]: s for s in saved}
    for (
        after
    ) in loaded:  # pipe 2 x data 1 now: ZeRO re-slices each stage's shards (stage 0: a replica)
        torch.testing.assert_close(after["params"], by_stage[after["stage"]]["params"])
        assert after["lr"] == by_stage[after["stage"]]["lr"] and after["steps"] == 2
    # An interrupted grid save: every stage sealed, grid.json never written. Refused by name.
    (tmp_path / "ckpt" / "global_step2" / "grid.json").unlink()
    for message in run_distributed(
        _load_fails, world_size=2, args=(zero_stage, path), timeout_s=180
    ):
        assert "grid.json was never written" in message, message


def _load_fails(rank, world_size, zero_stage, path):
    engine = _engine(zero_stage, stages=2)
    with pytest.raises(Exception) as e:
        engine.load_checkpoint(path)
    return str(e.value)


def _load_other_grid(rank, world_size, path):
    engine = _engine(1, stages=1)  # pipe 1 x data 2, from a pipe 2 x data 2 checkpoint
    with pytest.raises(Exception) as e:
        engine.load_checkpoint(path)
    return str(e.value)


def test_checkpoint_of_another_pipeline_shape_is_refused_naming_both_grids(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save_and_go_on, world_size=4, args=(1, path), timeout_s=180)
    for message in run_distributed(_load_other_grid, world_size=2, args=(path,), timeout_s=180):
        assert "pipe 2 x data 2 x expert 1" in message, message
        assert "pipe 1 x data 2 x expert 1" in message, message


def test_part_names_carry_stage_tensor_and_expert_rank() -> None:
    from types import SimpleNamespace

    from minispeed.engine.checkpoint.grid import GridPlace

    coords = {"pipe": (1, 2), "data": (0, 2), "expert": (1, 2)}
    grid = SimpleNamespace(
        topology=SimpleNamespace(axes=("pipe", "data", "expert")),
        rank_in=lambda axis: coords[axis][0],
        size=lambda axis: coords[axis][1],
    )
    place = GridPlace.from_grid(grid)
    assert place.part == "pipe01-of-02-expert01-of-02"
    assert place.shape() == {"pipe": 2, "data": 2, "expert": 2, "tensor": 1}
    assert GridPlace(stage=0, pipe=1, data_rank=1, data=4).part is None  # the tag itself
    assert GridPlace(stage=1, pipe=2, tensor_rank=1, tensor=2).part == "pipe01-of-02-tensor01-of-02"
    assert GridPlace(tensor_rank=0, tensor=2).part == "pipe00-of-01-tensor00-of-02"
    assert GridPlace(stage=1, pipe=3).part == "pipe01-of-03"


def test_a_pipeline_checkpoint_saved_without_zero_by_an_older_engine_is_refused(tmp_path) -> None:
    """Before the pipeline engine became the engine, a pipeline without ZeRO saved one
    model_states.pt per stage (`"sharded": false` in grid.json); every engine now saves ZeRO's
    files, and such a tag is refused by name instead of failing inside zero's loader."""
    from minispeed.engine.checkpoint.grid import GridPlace, Part, check_grid
    from minispeed.zero.checkpoints import CheckpointError

    part = Part(GridPlace(stage=0, pipe=2), nn.Linear(2, 2), None, {}, partition=[0, 2, 4])
    saved = {"grid": {"pipe": 2, "data": 1, "expert": 1}, "sharded": False, "partition": [0, 2, 4]}
    with pytest.raises(CheckpointError, match="saved without ZeRO by an older minispeed"):
        check_grid(saved, part, tmp_path)
    check_grid({**saved, "sharded": True}, part, tmp_path)  # today's tags load
