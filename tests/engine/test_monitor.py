"""DeepSpeed's monitor sections (`csv_monitor`, `tensorboard`, `wandb`, `comet`): the DeepSpeed
script `scripts/record_ds_monitor.py` run with only its imports changed to minispeed's, on 2
gloo processes, leaves the files DeepSpeed 0.19.8 left (`fixtures/ds_monitor.json`): the same
files on the same rank, the same headers, steps and values (timers: their names and steps
only), the same appending on a second run, the same TensorBoard events."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed
from minispeed.engine.config import ConfigError, EngineConfig
from minispeed.profiler import monitor

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_monitor.json"
IMPORTS = {
    **ds_scripts.PLAIN_IMPORTS,
    "from deepspeed.pipe import LayerSpec, PipelineModule\n": (
        "from minispeed.engine.pipe import LayerSpec, PipelineModule\n"
    ),
}


def _run_script(rank, world_size, root):
    return ds_scripts.load("record_ds_monitor.py", IMPORTS).main(root)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitor")
    return run_distributed(_run_script, world_size=2, args=(str(root),), timeout_s=120)


def _recorded():
    return json.loads(FIXTURE.read_text())["ranks"]


def _is_timer(name):
    return "elapsed_time_ms_" in name


def _same_rows(got, want, name):
    """CSV rows: headers and steps exactly, values within 1e-5 (a timer's: any number >= 0)."""
    assert len(got) == len(want), (name, got, want)
    for g, w in zip(got, want, strict=True):
        if w[0] == "step":  # a header row (a second run appends a second one)
            assert g == w, name
            continue
        assert int(g[0]) == int(w[0]), (name, g, w)
        value = float(g[1])
        assert value >= 0.0, (name, g)
        if not _is_timer(name):
            assert value == pytest.approx(float(w[1]), rel=1e-5, abs=1e-7), (name, g, w)


def test_fixture_was_recorded_on_deepspeed_0_19_8():
    assert json.loads(FIXTURE.read_text())["deepspeed"] == "0.19.8"


def test_csv_files_match_deepspeed(runs):
    """Per case (fp32 with the timers, accumulation, bf16, fp16's loss scale, a second run into
    the same job, a pipeline's losses): rank 0 writes the same files as DeepSpeed, rank 1's
    folder (its own output_path) is never created."""
    for rank, (got, want) in enumerate(zip(runs, _recorded(), strict=True)):
        assert set(got["cases"]) == set(want["cases"])
        for case, files in want["cases"].items():
            csv_want = {k: v for k, v in files.items() if k.endswith(".csv")}
            csv_got = {k: v for k, v in got["cases"][case].items() if k.endswith(".csv")}
            assert sorted(csv_got) == sorted(csv_want), (rank, case)
            for name, rows in csv_want.items():
                _same_rows(csv_got[name], rows, f"rank {rank} {case} {name}")


def test_tensorboard_events_match_deepspeed(runs):
    """With `tensorboard` installed: the same (tag, step) sequence in the event file, values
    within 1e-5 (timers excluded)."""
    if not runs[0]["tensorboard"]:
        pytest.skip("the tensorboard package is not installed (pip install tensorboard)")
    for got, want in zip(runs, _recorded(), strict=True):
        for case, files in want["cases"].items():
            for name, events in files.items():
                if name.endswith(".csv"):
                    continue
                mine = got["cases"][case][name]
                assert [e[:2] for e in mine] == [e[:2] for e in events], (case, name)
                for (tag, _, value), (_, _, ref) in zip(mine, events, strict=True):
                    if not _is_timer(tag):
                        assert value == pytest.approx(ref, rel=1e-5, abs=1e-7), (case, tag)


def test_missing_tensorboard_names_the_key_and_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard fails
    cfg = EngineConfig.from_ds_config(
        {
            "train_batch_size": 1,
            "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
        }
    )
    with pytest.raises(ImportError, match=r"tensorboard\.enabled.*pip install tensorboard"):
        monitor.MonitorMaster(cfg.monitor, rank=0)
    # another rank builds nothing, so it needs nothing
    assert monitor.MonitorMaster(cfg.monitor, rank=1).monitors == []


def test_monitor_sections_are_checked_by_key():
    with pytest.raises(ConfigError, match=r"csv_monitor\.job"):
        EngineConfig.from_ds_config({"train_batch_size": 1, "csv_monitor": {"job": "x"}})
    with pytest.raises(ConfigError, match=r"wandb\.project"):
        EngineConfig.from_ds_config({"train_batch_size": 1, "wandb": {"project": 3}})


def test_comet_logs_a_name_again_after_samples_log_interval():
    """DeepSpeed's EventsLogScheduler: the first event of a name, then one at least
    `samples_log_interval` samples after the last logged."""
    scheduler = monitor.EventsLogScheduler(10)
    steps = [0, 4, 10, 12, 19, 20, 35]
    assert [s for s in steps if scheduler.needs_logging("lr", s)] == [0, 10, 20, 35]
    assert scheduler.needs_logging("loss", 4)  # names are scheduled apart
