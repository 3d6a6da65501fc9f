"""offload's shard homes implement the interface zero's stage 3 defines, without importing zero.

`HostShards` / `NvmeShards` (shard_homes.py) are where a released ZeRO-3 parameter shard lives
(issue 21 §1: zero defines `ShardHome`, offload implements it). Here a stand-in parameter with
the same moves as zero's `ShardedParam` (asserting, like its `Residency`) goes through a shard's
life: adopted (the value leaves memory), fetched (the value comes back, bytes read counted),
evicted, written (a new value lands in the home without becoming resident), fetched again. A
failed read goes through the caller's guard and hands out zeros.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from minispeed.offload import HostShards, NvmeShards, OffloadParamConfig


class Param:
    """The part of zero's ShardedParam a home uses: name, shard, shard_numel, away, to_*."""

    def __init__(self, values: torch.Tensor) -> None:
        self.name = "w"
        self.shard = values.clone()
        self.shard_numel = values.numel()
        self.place = "here"
        self.home = None

    @property
    def away(self) -> bool:
        return self.place == "away"

    def to_away(self, home=None) -> None:
        assert (self.place == "here" and home is not None) or (
            self.place == "fetched" and home in (None, self.home)
        ), f"to_away from {self.place}"
        self.home = home or self.home
        self.shard = self.shard.new_empty(0)
        self.place = "away"

    def to_fetched(self, shard: torch.Tensor) -> None:
        assert self.place == "away", f"to_fetched from {self.place}"
        self.shard = shard
        self.place = "fetched"


class Failures:
    """The caller's record of failed I/O (zero's IOFailures has the same two members)."""

    def __init__(self) -> None:
        self.settlers: list = []
        self.recorded: list[str] = []

    @contextlib.contextmanager
    def guard(self, what: str):
        try:
            yield
        except OSError:
            self.recorded.append(what)


def _life(home, values: torch.Tensor) -> Param:
    sp = Param(values)
    home.adopt(sp)
    assert sp.away and sp.shard.numel() == 0 and sp.home is home
    home.fetch(sp)
    assert sp.place == "fetched"
    torch.testing.assert_close(sp.shard, values, rtol=0, atol=0)
    home.fetch(sp)  # resident already: nothing read
    home.evict(sp)
    assert sp.away and sp.shard.numel() == 0
    home.write(sp, values * 2)  # a new value, straight into the home
    home.flush()
    assert sp.away
    home.fetch(sp)
    torch.testing.assert_close(sp.shard, values * 2, rtol=0, atol=0)
    home.evict(sp)
    with pytest.raises(AssertionError, match="to_away from away"):
        home.evict(sp)  # an illegal move is refused, not ignored
    return sp


def test_host_shards_hold_the_value_while_away() -> None:
    values = torch.arange(10, dtype=torch.float32)
    home = HostShards(pin_memory=False)
    _life(home, values)
    assert home.io_failures is None
    assert home.bytes_read == 2 * 10 * 4 and home.bytes_written == 10 * 4
    assert home.resident_bytes() == 40


def test_nvme_shards_hold_the_value_in_a_file(tmp_path: Path) -> None:
    values = torch.arange(10, dtype=torch.bfloat16)
    cfg = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_numel=64)
    failures = Failures()
    home = NvmeShards(cfg, None, torch.bfloat16, [], failures)
    sp = _life(home, values)
    assert failures.settlers == [home.swapper.wait_all] and not failures.recorded
    assert home.bytes_read >= 2 * 10 * 2 and home.bytes_written >= 2 * 10 * 2
    Path(home.files[id(sp)].path).unlink()  # the file vanishes under the job
    home.fetch(sp)
    assert failures.recorded == ["reading the shard of 'w'"]
    assert torch.equal(sp.shard, torch.zeros(10, dtype=torch.bfloat16))  # a placeholder
    home.close()


def test_the_homes_do_not_import_zero() -> None:
    import minispeed.offload.shard_homes as homes

    source = Path(homes.__file__).read_text()
    assert "minispeed.zero" not in source.split('"""', 2)[2]  # the code, past the docstring
