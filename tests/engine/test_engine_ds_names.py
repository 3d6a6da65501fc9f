"""Every public name of DeepSpeed 0.19.8's `DeepSpeedEngine` and `PipelineEngine` (recorded in
fixtures/ds_engine_names.json by `scripts/record_ds_engine_names.py`) answers on minispeed's
engines, or is declined by name (`NotProvided`, whose message says what to use instead); never
a plain `AttributeError`. Then the recorded script runs on 2 gloo ranks with its import line
changed, against DeepSpeed's answers: the config accessors for two configs, a training run
whose batch size changes three times (`set_train_batch_size`, `set_train_micro_batch_size`:
losses, window ends and final weights), `module_state_dict` / `load_module_state_dict`, the
timers' names and the dataset predicates. Differences on purpose, each asserted below: the
ranks (DeepSpeed's assert without a Megatron `mpu`), `communication_data_type` with bf16
(minispeed reduces in float32 there), DeepSpeed's micro-step timers (not kept)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURE = json.loads(
    (Path(__file__).resolve().parent / "fixtures/ds_engine_names.json").read_text()
)
NAMES = FIXTURE["ranks"][0]["names"]
# DeepSpeed 0.19.8's get_*_parallel_rank assert unless initialize got a Megatron mpu; minispeed
# answers from its grid. communication_data_type: see DeepSpeedQueries.communication_data_type.
RANKS = ("get_data_parallel_rank", "get_model_parallel_rank", "get_tensor_parallel_rank")


def _walk(engine, names: list[str]) -> dict[str, str]:
    """`{name: what went wrong}` for each name that neither answers nor is declined with a
    message naming minispeed."""
    from minispeed.engine.missing import NotProvided

    wrong = {}
    for name in names:
        try:
            getattr(engine, name)
        except NotProvided as e:
            if "minispeed" not in str(e) or hasattr(engine, name):
                wrong[name] = f"declined without a message, or hasattr true: {e}"
        except AttributeError as e:
            wrong[name] = f"plain AttributeError: {e}"
    return wrong


def _pipeline(rank: int, world_size: int) -> dict:
    """A 2-stage pipeline: its names, and `reset_activation_shape` before a longer sequence."""
    from minispeed.engine import pipe
    from minispeed.engine.pipe_engine import PipelineEngine
    from minispeed.pipeline.p2p import PipelineShapeError

    torch.manual_seed(0)
    layers = [pipe.LayerSpec(nn.Linear, 4, 4) for _ in range(2)]
    model = pipe.PipelineModule(layers, num_stages=2, loss_fn=nn.functional.mse_loss)
    engine = PipelineEngine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"train_batch_size": 2}
    )

    def batch(seq: int):
        return iter([(torch.ones(2, seq, 4), torch.zeros(2, seq, 4))])

    out = {"wrong": _walk(engine, NAMES["pipe"]), "stage": engine.get_pipeline_parallel_rank()}
    engine.train_batch(batch(3))
    engine.reset_activation_shape()
    out["longer"] = float(engine.train_batch(batch(5)))  # negotiated again: trains
    try:
        engine.train_batch(batch(7))  # without the reset: refused by name on every rank
        out["unreset"] = ""
    except PipelineShapeError as e:
        out["unreset"] = str(e)
    try:
        engine.set_train_batch_size(4)
        out["resize"] = ""
    except NotImplementedError as e:
        out["resize"] = str(e)
    engine.destroy()
    return out


def _names_and_script(rank: int, world_size: int) -> dict:
    import minispeed.engine as deepspeed

    model = nn.Linear(2, 2)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    out = {"wrong": _walk(engine, NAMES["engine"])}
    try:
        engine.allreduce_bucket  # noqa: B018 (the attribute access is the test)
    except AttributeError as e:
        out["declined"] = [type(e).__name__, str(e), hasattr(engine, "allreduce_bucket")]
    engine.destroy()
    out["script"] = ds_scripts.load("record_ds_engine_names.py", ds_scripts.PLAIN_IMPORTS).main()
    out["pipeline"] = _pipeline(rank, world_size)
    return out


def test_every_deepspeed_engine_name_answers_as_deepspeeds_or_is_declined():
    runs = run_distributed(_names_and_script, world_size=2, timeout_s=300)
    for rank, (res, ref) in enumerate(zip(runs, FIXTURE["ranks"], strict=True)):
        assert res["wrong"] == {}
        assert res["declined"][0] == "NotProvided" and not res["declined"][2]
        assert "minispeed.zero" in res["declined"][1]  # says where the reduction happens
        ours, want = res["script"], {k: v for k, v in ref.items() if k != "names"}
        # The accessors: DeepSpeed's answers, but for the ranks and bf16's reduction dtype.
        for config, answers in want["accessors"].items():
            for name, value in answers.items():
                got = ours["accessors"][config][name]
                if name in RANKS:
                    assert value == {"error": "AssertionError"}
                    assert got == {"get_data_parallel_rank": rank}.get(name, 0), (config, name)
                elif name == "communication_data_type" and value == "torch.bfloat16":
                    assert got == "torch.float32"
                else:
                    ds_scripts.assert_matches(got, value, path=f"{config}/{name}")
        # The batch resized mid-run: DeepSpeed's losses, window ends, batch triples, weights;
        # DeepSpeed's error for a batch that does not divide, with the numbers added.
        for stage, run in want["resized"].items():
            error = ours["resized"][stage].pop("not_divisible")
            assert error.startswith(run.pop("not_divisible")) and "multiple of 4" in error
            ds_scripts.assert_matches(ours["resized"][stage], run, path=stage)
        ds_scripts.assert_matches(ours["state_dicts"], want["state_dicts"])
        ds_scripts.assert_matches(ours["helpers"], want["helpers"])
        # The timers: empty without wall_clock_breakdown; with it, DeepSpeed's whole-step names.
        assert ours["timers"]["False"] == want["timers"]["False"]
        assert ours["timers"]["True"]["names"] == ["bwd", "fwd", "step"]
        assert set(ours["timers"]["True"]["names"]) <= set(want["timers"]["True"]["names"])
        assert ours["timers"]["True"]["non_negative"]
        pipeline = res["pipeline"]
        assert pipeline["wrong"] == {} and pipeline["stage"] == rank
        assert pipeline["longer"] > 0 and "shape" in pipeline["unreset"].lower()
        assert "gradient_accumulation_steps" in pipeline["resize"]


def test_fixture_was_recorded_on_deepspeed_0_19_8():
    assert FIXTURE["deepspeed"] == "0.19.8"
    assert len(NAMES["engine"]) == 228 and "set_train_batch_size" in NAMES["engine"]
