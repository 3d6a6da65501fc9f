"""`minispeed estimate` against the published clusters: the ZeRO paper's Table 1 cell for cell,
ZeRO-Infinity's and ZeRO-3 Offload's largest models, and `--time` against three published
measurements (docs/cli/estimate.md#published-clusters gives the sources and the inputs)."""

from __future__ import annotations

import json

import pytest

from minispeed.comm import costs
from minispeed.engine.cli import main
from minispeed.engine.cli.cluster_time import Workload, predict_stages
from minispeed.engine.cli.clusters import Cluster
from minispeed.zero.memory.modes import estimate_modes, largest_params

# Rajbhandari et al., SC20, Table 1: GB per device, mixed-precision Adam (K = 12), columns
# Pos, Pos+g, Pos+g+p, rows DP = 1, 4, 16, 64, 256, 1024, as printed in the paper.
TABLE_1 = {
    7.5e9: [["120", "120", "120"], ["52.5", "41.3", "30"], ["35.6", "21.6", "7.5"],
            ["31.4", "16.6", "1.88"], ["30.4", "15.4", "0.47"], ["30.1", "15.1", "0.12"]],
    128e9: [["2048", "2048", "2048"], ["896", "704", "512"], ["608", "368", "128"],
            ["536", "284", "32"], ["518", "263", "8"], ["513", "257", "2"]],
    1e12: [["16000", "16000", "16000"], ["7000", "5500", "4000"], ["4750", "2875", "1000"],
           ["4187", "2218", "250"], ["4046", "2054", "62.5"], ["4011", "2013", "15.6"]],
}  # fmt: skip
GiB = 2**30


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["estimate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("psi", list(TABLE_1), ids=lambda p: f"{p:.3g}")
def test_paper_table_1_every_cell(capsys, psi) -> None:
    code, out, _ = _cli(capsys, "--paper", "--params", f"{psi:g}", "--dp", "1,4,16,64,256,1024",
                        "--json")  # fmt: skip
    assert code == 0
    got = [list(r["gb"].values()) for r in json.loads(out)]
    assert got == TABLE_1[psi]


def test_largest_params_is_the_exact_boundary() -> None:
    """Each row's Ψ fits and Ψ + 1 does not (or nothing limits it)."""
    sizes = dict(gpu_bytes=32 * GiB, cpu_bytes_per_node=1536 * GiB, nvme_bytes_per_node=28 * 10**12)
    found = largest_params(16, 2, largest_layer_params=10**6, **sizes)
    assert len(found) == len(estimate_modes(10**9, 16, 2))
    for i, (row, psi) in enumerate(found):
        assert psi, row
        at = estimate_modes(psi, 16, 2, largest_layer_params=10**6)[i]
        above = estimate_modes(psi + 1, 16, 2, largest_layer_params=10**6)[i]
        assert at == row and at.fits(*sizes.values()) and not above.fits(*sizes.values())


@pytest.mark.parametrize(
    ("claim", "gpus", "nodes", "offload", "published"),
    [
        # ZeRO-Infinity (SC21): "1T params on a single node", "32T params on 32 nodes", NVMe.
        ("infinity-1-node", 16, 1, "optimizer+params->nvme", 1e12),
        ("infinity-32-nodes", 16, 32, "optimizer+params->nvme", 32e12),
        # ZeRO-3 Offload (DeepSpeed, 2021): 1T on 256 and 2T on 512 V100s, CPU memory.
        ("offload-256-gpus", 16, 16, "optimizer+params->cpu", 1e12),
        ("offload-512-gpus", 16, 32, "optimizer+params->cpu", 2e12),
    ],
)
def test_largest_models_on_dgx2_nodes_match_the_papers(claim, gpus, nodes, offload, published):
    """DGX-2 nodes (16 x 32 GiB V100, 1.5 TiB CPU, 28 TB NVMe), DeepSpeed's figures with its
    buffer factor 1.5 and zero_init, L of the 1T model (4 x 25,600²): within 5% of the claim."""
    found = largest_params(
        gpus, nodes, gpu_bytes=32 * GiB, cpu_bytes_per_node=1536 * GiB,
        nvme_bytes_per_node=28 * 10**12, largest_layer_params=4 * 25_600**2,
    )  # fmt: skip
    (psi,) = [p for r, p in found if r.offload.value == offload and r.zero_init]
    assert abs(psi / published - 1) < 0.05, (claim, psi)


def _v100(**values) -> Cluster:
    return Cluster.load("dgx2-v100").with_values(**values)


def test_zero_100b_on_400_v100s_within_25_percent_of_38_tflops() -> None:
    """ZeRO (SC20): ZeRO-100B (Pos+g, Megatron MP 16 in a DGX-2) trains 100B parameters on 400
    V100s at 38 TFLOP/s per GPU; 125 blocks of 8,192, 32 x 1,024 tokens per replica assumed."""
    w = Workload(num_params=100 * 10**9, layers=125, hidden=8192, vocab=50257, seq=1024,
                 batch=32, micro_batch=32, tp=16, checkpointing=True)  # fmt: skip
    (row,) = predict_stages(_v100(), w, 25, stages=(2,))
    assert abs(row.tflops_per_gpu / 38 - 1) < 0.25, row.tflops_per_gpu


def _zeropp(inter_gbps: float, batch: int = 1):
    w = Workload(num_params=138 * 10**9, layers=171, hidden=8192, vocab=50257, seq=1024,
                 batch=batch, micro_batch=batch)  # fmt: skip
    return predict_stages(_v100(inter_gbps=inter_gbps), w, 24, stages=(3,), zeropp=True)


def test_zeropp_cross_node_bytes_fall_4x() -> None:
    """ZeRO++ (Wang et al. 2023): 3M -> 0.75M bytes across nodes per step (qwZ 0.5M, hpZ 0,
    qgZ 0.25M), priced by the ZeRO++ ledger: within 25% of 4x."""
    plain, zpp = _zeropp(100)
    assert abs(plain.cross_node_bytes_per_node / zpp.cross_node_bytes_per_node / 4 - 1) < 0.25


def test_zeropp_speedup_at_100_gbps_within_25_percent_of_2_2x() -> None:
    """ZeRO++ on 384 V100s with one 100 Gb/s link per node: up to 2.2x ZeRO-3's throughput."""
    plain, zpp = _zeropp(12.5)
    speedup = plain.step_s / zpp.step_s
    assert abs(speedup / 2.2 - 1) < 0.25, speedup


def test_a_data_parallel_ring_shares_the_nodes_nics() -> None:
    """Note [a ring across nodes]: stage 0's all-reduce over DP ranks one per node (TP 16) runs
    at a sixteenth of the node's NIC rate; on one node at NVLink's; the TP all-reduces at NVLink's."""
    c = _v100(inter_latency_us=0, intra_latency_us=0, hbm_gbps=None)
    w = Workload(num_params=16 * 10**9, layers=2, hidden=1024, vocab=64, seq=8, batch=1,
                 micro_batch=1, tp=16)  # fmt: skip
    (row,) = predict_stages(c, w, 4, stages=(0,))
    wire = costs.wire_bytes("all_reduce", 2 * 10**9, 4)  # Ψ/16 fp16 gradients, 4 ranks
    assert row.prediction.comm_s == pytest.approx(wire / (100e9 / 16), rel=1e-3)
    w1 = Workload(num_params=16 * 10**9, layers=2, hidden=1024, vocab=64, seq=8, batch=1,
                  micro_batch=1)  # fmt: skip
    (one,) = predict_stages(c, w1, 1, stages=(0,))
    wire = costs.wire_bytes("all_reduce", 32 * 10**9, 16)
    assert one.prediction.comm_s == pytest.approx(wire / 150e9, rel=1e-3)
    assert one.tp_comm_s == 0 and row.tp_comm_s > 0


def test_a_cluster_file_equals_the_preset_with_the_same_values(tmp_path, capsys) -> None:
    preset = Cluster.load("dgx2-v100")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**preset.to_json(), "inter_gbps": 25}))
    args = ["--time", "--params", "2e9", "--nodes", "2", "--layers", "4", "--hidden", "1024",
            "--batch", "4", "--json"]  # fmt: skip
    _, from_file, _ = _cli(capsys, *args, "--cluster", str(path))
    _, from_flag, _ = _cli(capsys, *args, "--cluster", "dgx2-v100", "--inter-gbps", "25")
    rows = [json.loads(t)["rows"] for t in (from_file, from_flag)]
    assert rows[0] == rows[1] and len(rows[0]) == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--efficiency", "nan"], "efficiency must be a finite number > 0"),
        (["--efficiency", "1.5"], "efficiency is a fraction"),
        (["--inter-gbps", "-1"], "inter_gbps must be a finite number > 0"),
        (["--peak-tflops", "inf"], "peak_tflops must be a finite number > 0"),
        (["--batch", "0"], "batch must be a whole number >= 1"),
        (["--micro-batch", "0"], "micro_batch must be a whole number >= 1"),
        (["--seq", "-5"], "seq must be a whole number >= 1"),
        (["--intra-latency-us", "-1"], "intra_latency_us must be a finite number >= 0"),
        (["--tp", "3"], "--tp 3 must divide the 16 GPUs"),
        (["--overlap", "2"], "--overlap is a fraction in [0, 1]"),
        (["--stages", "4"], "--stages takes ZeRO stages 0-3"),
        (["--cluster", "nope"], "neither a preset"),
        (["--params", "inf"], "--params must be a whole number >= 1"),
        (["--params", "nan"], "--params must be a whole number >= 1"),
        (["--zeropp"], "--zeropp prices ZeRO++'s cross-node savings: give --nodes >= 2"),
    ],
)
def test_bad_time_input_exits_2_naming_it(capsys, extra, message) -> None:
    base = {"--params": "1e9", "--cluster": "dgx2-v100", "--layers": "2", "--hidden": "64",
            "--batch": "2"}  # fmt: skip
    for flag, value in zip(extra[::2], extra[1::2]):
        base[flag] = value
    argv = [a for kv in base.items() for a in kv] + [e for e in extra if e == "--zeropp"]
    code, _, err = _cli(capsys, "--time", *argv)
    assert code == 2 and message in err, err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ('{"peak_tflops": 1}', "missing keys"),
        ('{"gpus_per_node": 8, "peak_tflop": 1}', "unknown keys ['peak_tflop']"),
    ],
)
def test_bad_cluster_file_exits_2(tmp_path, capsys, content, message) -> None:
    path = tmp_path / "c.json"
    path.write_text(content)
    code, _, err = _cli(capsys, "--time", "--params", "1e9", "--cluster", str(path),
                        "--layers", "2", "--hidden", "64", "--batch", "1")  # fmt: skip
    assert code == 2 and message in err, err


def test_largest_and_paper_bad_input_exit_2(capsys) -> None:
    assert _cli(capsys, "--largest", "--gpus", "16")[0] == 2
    code, _, err = _cli(capsys, "--largest", "--gpu-mem", "nan")
    assert code == 2 and "--gpu-mem must be a finite number > 0" in err
    code, _, err = _cli(capsys, "--largest", "--gpu-mem", "32", "--buffer-factor", "-1")
    assert code == 2 and "--buffer-factor must be a finite number > 0" in err
    code, _, err = _cli(capsys, "--paper", "--params", "7.5e9", "--dp", "0,4")
    assert code == 2 and "--dp degrees must be >= 1" in err
