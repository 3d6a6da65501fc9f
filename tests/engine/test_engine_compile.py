"""`engine.compile()` at ZeRO-3 trains as DeepSpeed 0.19.8 and as the eager engine, and stage 3
still releases what it gathers.

`scripts/record_ds_compile_z3.py` (2 ranks, a tiny MLP at ZeRO-3, 3 steps eager and 3 steps
after `engine.compile(backend="aot_eager")`) runs here with its import line changed to
minispeed's; every rank's record must equal DeepSpeed's (`tests/engine/fixtures/
ds_compile_z3.json`): losses, gradient norms and final parameters. The Trainer with `torch_compile=True` at ZeRO-3 is test_compat_clients.py's
`compile_z3`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_compile_z3.json"


def _recorded(rank: int, world_size: int) -> dict:
    return ds_scripts.load("record_ds_compile_z3.py", ds_scripts.PLAIN_IMPORTS).main()


def test_compiled_stage3_trains_as_deepspeed_and_as_eager() -> None:
    fixture = json.loads(FIXTURE.read_text())
    assert fixture["deepspeed"] == "0.19.8"
    runs = run_distributed(_recorded, world_size=2, timeout_s=240)
    for rank, (ours, ref) in enumerate(zip(runs, fixture["ranks"], strict=True)):
        ds_scripts.assert_matches(ours, ref, 1e-5, f"rank {rank}")
        ds_scripts.assert_matches(ours["compiled"], ours["eager"] | {"compiled": True}, 1e-6)


def _gathered(rank: int, world_size: int, backend: str | None) -> dict:
    """One step: what stage 3 holds after the forward, its peak, and what dynamo compiled."""
    import torch
    from torch._dynamo.utils import counters

    from minispeed.zero.stage3.params import REGISTRY

    script = ds_scripts.load("record_ds_compile_z3.py", ds_scripts.PLAIN_IMPORTS)
    net = script.model()
    engine, _, _, _ = script.deepspeed.initialize(
        model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), config=script.CONFIG
    )
    torch._dynamo.reset()  # the worker may have compiled these forwards for another test
    counters.clear()
    if backend is not None:
        engine.compile(backend=backend)
    sps = [REGISTRY.get(p) for p in engine.module.parameters()]
    loss = engine(torch.randn(2, script.DIM)).pow(2).mean()
    gathered = sum(sp.full_storage_nbytes for sp in sps)
    engine.backward(loss)
    engine.step()
    return {
        "shard_bytes": sum(sp.shard.nbytes for sp in sps),
        "gathered_after_forward": gathered,
        "gathered_after_step": sum(sp.full_storage_nbytes for sp in sps),
        "peak_live_numel": engine.optimizer.strategy.coordinator.stats.peak_live_numel,
        "graphs": counters["stats"]["unique_graphs"],
        "aot_graphs": counters["aot_autograd"]["ok"],
    }


def test_compiled_stage3_releases_what_it_gathers() -> None:
    """Compiled, each `Linear`'s forward is one graph (3, each traced by AOTAutograd) while the
    stage-3 hooks run eagerly between them: after the forward only the shards are held (0 bytes
    behind the gathered buffers), and the most gathered at once is eager's."""
    eager = run_distributed(_gathered, world_size=2, timeout_s=120, args=(None,))
    compiled = run_distributed(_gathered, world_size=2, timeout_s=240, args=("aot_eager",))
    for e, c in zip(eager, compiled, strict=True):
        assert e["graphs"] == 0 and c["graphs"] == 3 and c["aot_graphs"] == 3, (e, c)
        assert c["gathered_after_forward"] == c["gathered_after_step"] == 0, c
        assert c["shard_bytes"] == e["shard_bytes"] > 0
        assert c["peak_live_numel"] == e["peak_live_numel"] > 0, (e, c)
