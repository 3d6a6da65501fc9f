"""DeepSpeed's monitor sections (`csv_monitor`, `tensorboard`, `wandb`, `comet`): the DeepSpeed
script `scripts/record_ds_monitor.py` run with only its imports changed to minispeed's, on 2
gloo processes, leaves the files DeepSpeed 0.19.8 left (`fixtures/ds_monitor.json`): the same
files on the same rank, the same headers, steps and values (timers: their names and steps
only), the same appending on a second run, the same TensorBoard events."""

import json
import sys
import time
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
    "from deepspeed.monitor.config import get_monitor_config\n": (
        "from minispeed.engine.monitor.config import get_monitor_config\n"
    ),
    "from deepspeed.monitor.monitor import MonitorMaster\n": (
        "from minispeed.engine.monitor.monitor import MonitorMaster\n"
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


def _wandb_records(path):
    """The records of a W&B offline run file (`run-<id>.wandb`: LevelDB's log format, 32 KiB
    blocks of records with a 7-byte header, after W&B's own 7-byte header)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # the end, or a record still written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _train_with_wandb(rank, world_size, root):
    script = ds_scripts.load("record_ds_monitor.py", IMPORTS)
    changes = dict(script.CASES["fp16"][0])
    changes["wandb"] = {"enabled": True, "project": "p", "group": "g"}
    script.train(rank, script.config(Path(root), "fp16", changes))


def test_wandb_logs_the_events_the_csv_files_hold(tmp_path):
    """With `wandb` installed (offline: nothing leaves the machine): rank 0's run is initialized
    with the project and group, and logs every event at its step, the same ones the CSV monitor
    writes (checked against DeepSpeed above); rank 1 starts no run."""
    pytest.importorskip("wandb", reason="the wandb package is not installed (pip install wandb)")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    run_distributed(_train_with_wandb, world_size=2, args=(str(tmp_path),), env=env, timeout_s=120)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # one run: rank 0's
    # wandb's service process writes the file behind the run's finish(): wait for its end
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(run_file)):
        assert time.monotonic() < deadline, "the W&B run file never got its exit record"
        time.sleep(0.2)
    logged, runs = {}, []
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append((record.run.project, record.run.run_group))
        elif kind == "history":
            for item in record.history.item:
                name = item.key or "/".join(item.nested_key)
                if not name.startswith("_"):
                    logged.setdefault(name, []).append(
                        [int(record.history.step.num), float(item.value_json)]
                    )
    assert runs == [("p", "g")]
    csv_dir = tmp_path / "rank0" / "csv" / "fp16"
    written = {}  # by file name: the event's name with "/" made "_"
    for path in csv_dir.glob("*.csv"):
        rows = path.read_text().split()[1:]  # past the header
        written[path.stem] = [[int(s), float(v)] for s, v in (row.split(",") for row in rows)]
    assert sorted(written) == [
        "Client_global_steps", "Train_Samples_loss_scale", "Train_Samples_lr"
    ]  # fmt: skip
    assert {name.replace("/", "_"): steps for name, steps in logged.items()} == written
