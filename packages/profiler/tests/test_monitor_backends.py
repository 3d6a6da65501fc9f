"""The monitors' backends on their own (minispeed.profiler.monitor): Comet's thinning of events
and an offline Comet experiment's metrics. The engine's events, checked against DeepSpeed
0.19.8's files, are tests/engine/test_monitor.py's."""

import json
import zipfile

import pytest

from minispeed.profiler import monitor


def test_comet_logs_a_name_again_after_samples_log_interval():
    """DeepSpeed's EventsLogScheduler: the first event of a name, then one at least
    `samples_log_interval` samples after the last logged."""
    scheduler = monitor.EventsLogScheduler(10)
    steps = [0, 4, 10, 12, 19, 20, 35]
    assert [s for s in steps if scheduler.needs_logging("lr", s)] == [0, 10, 20, 35]
    assert scheduler.needs_logging("loss", 4)  # names are scheduled apart


def test_offline_comet_experiment_holds_the_thinned_events(tmp_path, monkeypatch):
    """With `comet_ml` installed: an offline experiment (nothing leaves the machine) gets each
    event the scheduler lets through, as a metric at its step."""
    pytest.importorskip("comet_ml", reason='comet_ml is not installed (pip install "comet_ml")')
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    cfg = monitor.CometConfig(enabled=True, project="p", online=False, samples_log_interval=8)
    master = monitor.MonitorMaster(monitor.MonitorConfig(comet=cfg), rank=0)
    master.write_events(monitor.step_events(0.5, 16.0, 4))
    master.write_events(monitor.step_events(0.25, None, 8))  # 4 samples after: thinned
    master.write_events(monitor.step_events(0.125, None, 12))
    master.close()
    (archive,) = tmp_path.glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        lines = z.read("messages.json").decode().splitlines()
    metrics = [json.loads(line)["payload"]["metric"] for line in lines if '"metric_msg"' in line]
    logged = [
        [m["metricName"], m["metricValue"], m["step"]]
        for m in metrics
        if m["metricName"].startswith("Train/")
    ]
    assert logged == [
        ["Train/Samples/lr", 0.5, 4],
        ["Train/Samples/loss_scale", 16.0, 4],
        ["Train/Samples/lr", 0.125, 12],
    ]
