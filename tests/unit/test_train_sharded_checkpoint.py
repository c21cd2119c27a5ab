"""Sharded checkpoints (`save_sharded_state` / `load_sharded_state`, torch.distributed.checkpoint) in one process:
a save replaces the previous checkpoint only once complete, a save that fails leaves the previous one whole, the
metadata is checksummed, NaN is never written, and a load restores weights, optimizer state and step."""

from __future__ import annotations

import pytest
import torch

from longctx.training import checkpoint as ck


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).square().mean().backward()
    opt.step()
    return model, opt


def _save(directory, step, model, opt):
    return ck.save_sharded_state(
        directory, step=step, model=model, optimizer=opt, model_config={"h": 7}, train_config={"lr": 1e-2},
        extra={"last_eval": {"eval_loss": 1.5}},
    )  # fmt: skip


def test_save_then_load_restores_weights_optimizer_and_step(tmp_path):
    model, opt = _model_and_optimizer(0)
    _save(tmp_path / "ckpt", 3, model, opt)
    other, other_opt = _model_and_optimizer(1)
    assert ck.load_sharded_state(tmp_path / "ckpt", other, other_opt, {"h": 7}) == 3
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], other_opt.state[q]["exp_avg"])
    assert ck.read_sharded_meta(tmp_path / "ckpt")["extra"] == {"last_eval": {"eval_loss": 1.5}}


def test_a_new_save_replaces_the_previous_one_only_when_complete(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    model, opt = _model_and_optimizer(0)
    _save(tmp_path, 1, model, opt)
    _save(tmp_path, 2, model, opt)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process stops in the middle of writing the shards

    monkeypatch.setattr(dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3, model, opt)
    assert ck.latest_sharded(tmp_path).name == "step-00000002"  # the incomplete step-3.tmp is ignored
    assert ck.read_sharded_meta(tmp_path)["step"] == 2
    assert [p.name for p in ck.remove_partial_dirs(tmp_path)] == ["step-00000003.tmp"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]


def test_saving_the_same_step_again_keeps_one_complete_copy(tmp_path):
    model, opt = _model_and_optimizer(0)
    _save(tmp_path, 4, model, opt)
    _save(tmp_path, 4, model, opt)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004"]
    assert ck.read_sharded_meta(tmp_path)["step"] == 4


def test_non_finite_state_is_never_written(tmp_path):
    model, opt = _model_and_optimizer(0)
    _save(tmp_path, 1, model, opt)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(ck.CheckpointError, match=r"NaN or infinity in model/0.weight; the previous checkpoint is kept"):
        _save(tmp_path, 2, model, opt)
    assert ck.read_sharded_meta(tmp_path)["step"] == 1


def test_corrupt_metadata_and_missing_or_foreign_checkpoints_are_named(tmp_path):
    model, opt = _model_and_optimizer(0)
    with pytest.raises(ck.CheckpointError, match=r"no complete sharded checkpoint at"):
        ck.load_sharded_state(tmp_path, model, opt, {"h": 7})
    final = _save(tmp_path, 1, model, opt)
    with pytest.raises(ck.CheckpointError, match=r"another model configuration \(h: 7 -> 9\)"):
        ck.load_sharded_state(tmp_path, model, opt, {"h": 9})
    meta = final / ck.SHARDED_META
    data = torch.load(meta, weights_only=True)
    data["step"] = 99  # changed without its checksum
    torch.save(data, meta)
    with pytest.raises(ck.CheckpointError, match=r"is corrupt: the checksum of its non-tensor data"):
        ck.read_sharded_meta(tmp_path)


def test_a_damaged_shard_file_is_named_and_nothing_loads(tmp_path):
    """A byte flipped in a shard, or a shard removed, is caught by its CRC-32 before any tensor loads."""
    model, opt = _model_and_optimizer(0)
    final = _save(tmp_path, 2, model, opt)
    shards = sorted(p for p in final.iterdir() if p.suffix == ".distcp")
    assert shards and set(ck.read_sharded_meta(tmp_path)["shard_files"]) >= {p.name for p in shards}
    raw = bytearray(shards[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(raw))
    other, other_opt = _model_and_optimizer(1)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ck.CheckpointError, match=rf"{shards[0].name} \(checksum mismatch\)"):
        ck.load_sharded_state(tmp_path, other, other_opt, {"h": 7})
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    shards[0].unlink()
    with pytest.raises(ck.CheckpointError, match=rf"{shards[0].name} \(missing\)"):
        ck.load_sharded_state(tmp_path, other, other_opt, {"h": 7})
