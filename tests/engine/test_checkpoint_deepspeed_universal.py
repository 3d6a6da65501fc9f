"""DeepSpeed's universal checkpoints, both ways: training goes on as DeepSpeed 0.19.8's does.

Fixtures (`scripts/record_ds_universal.py`, `scripts/write_ms_universal.py`):
- `ds_checkpoint_<case>/global_step3_universal` + `latest_universal`: DeepSpeed's own
  `ds_to_universal` of its 2-rank checkpoint beside it;
- `ms_checkpoint_<case>/`: minispeed's 2-rank checkpoint (`latest`) and its conversion by
  `minispeed consolidate --to deepspeed-universal` (`latest_universal`);
- `ds_universal_world{1,2}.json`: DeepSpeed resuming from each universal folder with
  `checkpoint.load_universal` at 1 and 2 ranks, the 2 steps after. Its stage-3 resumes are also
  recorded "regrouped" (each group's weight decay and step tensor given back after the load:
  DeepSpeed's stage-3 universal load gives every group group 0's; the recorder's docstring), which
  equals DeepSpeed's native resume; minispeed keeps each group's own, so it is compared there.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURES = Path(__file__).resolve().parent / "fixtures"
UNIVERSAL = {"checkpoint": {"load_universal": True}}
# DeepSpeed's record to compare each minispeed run with (see the module docstring).
REFERENCE = {
    "deepspeed fp32 stage 2": "deepspeed fp32 stage 2",
    "deepspeed bf16 stage 3": "deepspeed bf16 stage 3 regrouped",
    "minispeed fp32 stage 2": "minispeed fp32 stage 2",
    "minispeed bf16 stage 3": "minispeed bf16 stage 3 regrouped",
}


def _fixture(world: int) -> dict:
    return json.loads((FIXTURES / f"ds_universal_world{world}.json").read_text())


def _script():
    return ds_scripts.load("record_ds_checkpoint_files.py", ds_scripts.RESUME_IMPORTS)


def _resume(script, root: Path, precision: str, stage: int, ranks, extra, tag=None) -> dict:
    engine = script.build(precision, stage, batch=script.BATCH * len(ranks), extra=extra)
    path, client = engine.load_checkpoint(str(root), tag=tag)
    out = {
        "path": Path(path).parent.name,
        "eval": script.evaluate(engine),
        "lr": engine.get_lr(),
        "counters": script.counters(engine),
        "client": {k: client[k] for k in ("epoch", "note")},
        "after": script.train(engine, ranks, script.SAVED_AT, script.MORE),
    }
    engine.destroy()
    return out


def _every_case(rank, world_size):
    """At world size 2 each rank trains its own batches; at 1, both ranks' side by side."""
    script = _script()
    ranks = [rank] if world_size == 2 else [0, 1]
    out = {}
    for precision, stage in (("fp32", 2), ("bf16", 3)):
        ds_root = script.case_dir(precision, stage)
        out[f"deepspeed {precision} stage {stage}"] = _resume(
            script, ds_root, precision, stage, ranks, UNIVERSAL
        )
        # minispeed's own checkpoint, resumed by minispeed (`latest`, no key)
        ms_root = FIXTURES / f"ms_checkpoint_{precision}_stage{stage}"
        out[f"minispeed {precision} stage {stage}"] = _resume(
            script, ms_root, precision, stage, ranks, None
        )
    if world_size == 2:  # minispeed's conversion read back; a universal tag without the key
        ms_root = FIXTURES / "ms_checkpoint_bf16_stage3"
        out["round trip"] = _resume(script, ms_root, "bf16", 3, ranks, UNIVERSAL)
        out["tagged into stage 1"] = _resume(
            script, script.case_dir("fp32", 2), "fp32", 1, ranks, None, "global_step3_universal"
        )
    else:  # without the key, a directory holding only the universal folder
        with tempfile.TemporaryDirectory() as tmp:
            only = shutil.copytree(script.case_dir("fp32", 2), Path(tmp) / "ckpt",
                                   ignore=shutil.ignore_patterns("latest", "global_step3"))  # fmt: skip
            out["only universal"] = _resume(script, only, "fp32", 2, ranks, None)
    return out


def _assert_like_deepspeeds(got: dict, want: dict, case: str) -> None:
    keys = ("eval", "lr", "counters", "client")
    ds_scripts.assert_matches({k: got[k] for k in keys}, {k: want[k] for k in keys}, path=case)
    ds_scripts.assert_matches(got["after"], want["after"], path=case)


def test_universal_checkpoints_resume_as_deepspeed_does_on_two_ranks():
    """DeepSpeed's universal folders (stage 2 fp32, stage 3 bf16; 2 ranks wrote them) loaded
    with `checkpoint.load_universal` through `latest_universal`: DeepSpeed's losses after its own
    universal load. minispeed's own checkpoint resumed by minispeed: the losses DeepSpeed had
    after loading minispeed's universal conversion of it, and so does minispeed loading that
    conversion. A universal tag loaded without the key, into a stage-1 engine: the same losses
    as stage 2."""
    runs = run_distributed(_every_case, world_size=2, timeout_s=300)
    for ours, ref in zip(runs, _fixture(2)["ranks"], strict=True):
        other = ours.pop("tagged into stage 1")
        ds_scripts.assert_matches(other["after"], ref["deepspeed fp32 stage 2"]["after"])
        back = ours.pop("round trip")
        assert back["path"] == "global_step3_universal"
        _assert_like_deepspeeds(back, ref[REFERENCE["minispeed bf16 stage 3"]], "round trip")
        for case, got in ours.items():
            if case.startswith("deepspeed"):
                assert got["path"] == "global_step3_universal", case  # latest_universal
            _assert_like_deepspeeds(got, ref[REFERENCE[case]], case)


def test_universal_checkpoints_of_two_ranks_resume_on_one():
    """Written by 2 ranks, resumed by 1 (each micro-batch both ranks' batches): DeepSpeed's
    losses at one rank, for DeepSpeed's universal folders and for minispeed's conversion; a
    directory holding only the universal folder and `latest_universal` loads without the key."""
    (ours,) = run_distributed(_every_case, world_size=1, timeout_s=300)
    (ref,) = _fixture(1)["ranks"]
    alone = ours.pop("only universal")  # `latest_universal` read without the key
    assert alone["path"] == "global_step3_universal"
    _assert_like_deepspeeds(alone, ref["deepspeed fp32 stage 2"], "only universal")
    for case, got in ours.items():
        _assert_like_deepspeeds(got, ref[REFERENCE[case]], case)


def _files(root: Path) -> dict[str, object]:
    return {
        str(p.relative_to(root)): torch.load(p, weights_only=True)
        for p in sorted(root.rglob("*.pt"))
    }


@pytest.mark.parametrize("case", ["fp32_stage2", "bf16_stage3"])
def test_the_conversion_writes_the_folder_deepspeed_resumed_from(tmp_path, case):
    """`minispeed consolidate CKPT OUT --to deepspeed-universal` on the kept minispeed
    checkpoint writes, file for file, the folder DeepSpeed resumed from in the recording (so
    its losses hold for this converter), and `latest_universal` naming it."""
    from minispeed.engine.cli.main import main

    src = FIXTURES / f"ms_checkpoint_{case}"
    ckpt = shutil.copytree(src, tmp_path / "ckpt", ignore=shutil.ignore_patterns("*universal"))
    out = ckpt / "global_step3_universal"
    assert main(["consolidate", str(ckpt), str(out), "--to", "deepspeed-universal"]) == 0
    assert (ckpt / "latest_universal").read_text() == "global_step3_universal"
    got, want = _files(out), _files(src / "global_step3_universal")
    assert list(got) == list(want)
    for name in want:
        ds_scripts.assert_matches(_plain(got[name]), _plain(want[name]), path=name)
    # A second conversion into the same folder is refused; the first stays whole.
    assert main(["consolidate", str(ckpt), str(out), "--to", "deepspeed-universal"]) == 1


def _plain(value):
    """Tensors as lists, sizes as tuples, for `assert_matches`."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    """A write that fails midway (the fifth file) leaves no output folder, no temporary folder
    and no `latest_universal`: DeepSpeed never sees half a checkpoint."""
    from minispeed.engine.checkpoint import universal

    real, calls = universal.atomic_save, []

    def dies(obj, path):
        calls.append(path)
        if len(calls) == 5:
            raise OSError("disk full")
        return real(obj, path)

    monkeypatch.setattr(universal, "atomic_save", dies)
    src = FIXTURES / "ms_checkpoint_fp32_stage2/global_step3"
    with pytest.raises(OSError, match="disk full"):
        universal.write_universal(src, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def _mutated(tmp_path: Path, edit) -> Path:
    root = shutil.copytree(FIXTURES / "ds_checkpoint_fp32_stage2", tmp_path / "ckpt")
    tag = root / "global_step3_universal"
    path = tag / "zero/0.weight/fp32.pt"
    saved = torch.load(path, weights_only=True)
    edit(saved)
    torch.save(saved, path)
    return tag


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update(vocab_tensor=True), r"vocab_tensor.*tensor-parallel"),
        (lambda s: s.update(param=s["param"][:3]), r"holds 15 elements, .* needs 35"),
    ],
)
def test_a_tensor_parallel_universal_checkpoint_is_refused_by_name(tmp_path, edit, message):
    """A universal tensor that needs a tensor rank's cut (Megatron's marks, or a slice) is
    refused naming the file, never loaded into the wrong shape."""
    from minispeed.engine.checkpoint.deepspeed_files import read_tag
    from minispeed.zero.checkpoints import CheckpointError

    with pytest.raises(CheckpointError, match=message):
        read_tag(_mutated(tmp_path, edit))


def _frozen_and_buffers(rank, world_size, root):
    """A model with a frozen weight and BatchNorm's buffers (an int counter among them), ZeRO-3:
    trained 2 steps and saved, converted to a universal folder (with an fp32.pt per buffer, as
    DeepSpeed's ds_to_universal writes them), loaded by a fresh engine with
    `checkpoint.load_universal`: every tensor of its state dict as saved (dtypes included), and
    the next step's loss the same as the engine that saved it."""
    import minispeed.engine as deepspeed
    from minispeed.engine.checkpoint.universal import write_universal

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)
        )
        model[0].weight.requires_grad_(False)
        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **UNIVERSAL}  # fmt: skip
        params = [p for p in model.parameters() if p.requires_grad]
        return deepspeed.initialize(model=model, model_parameters=params, config=config)[0]

    def step(engine, i):
        g = torch.Generator().manual_seed(i)
        loss = engine(torch.randn(4, 4, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
        return loss.item()

    engine = build(3)
    for i in range(2):
        step(engine, i)
    engine.save_checkpoint(root, tag="t")
    if rank == 0:
        out = write_universal(Path(root) / "t", Path(root) / "t_universal")
        for name, buf in engine.module.named_buffers():  # as ds_to_universal writes them
            (out / "zero" / name).mkdir()
            torch.save({"param": buf.float()}, out / "zero" / name / "fp32.pt")
    import minispeed.comm as comm

    comm.barrier()
    saved = {n: t.clone() for n, t in engine.module.state_dict().items()}
    want = step(engine, 2)
    engine.destroy()
    fresh = build(4)  # another initialization: the frozen weight must come from the folder
    path, _ = fresh.load_checkpoint(root)  # latest_universal, by the key
    got = fresh.module.state_dict()
    same = {n: bool(t.dtype == got[n].dtype and torch.equal(t, got[n])) for n, t in saved.items()}
    return Path(path).parent.name, same, want, step(fresh, 2)


def test_frozen_weights_and_buffers_survive_the_universal_round_trip(tmp_path):
    """minispeed → universal → minispeed with a frozen weight and buffers (module docstring of
    `_frozen_and_buffers`), on 1 rank."""
    ((path, same, want, got),) = run_distributed(
        _frozen_and_buffers, world_size=1, args=(str(tmp_path),), timeout_s=120
    )
    assert path == "t_universal"
    assert all(same.values()), same
    assert got == pytest.approx(want, rel=1e-6)
