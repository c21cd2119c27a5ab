"""`longctx train`: configuration (flags, YAML with Megatron/NeMo names), a smoke run, exact resume, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from longctx.training import checkpoint as ckpt_mod
from longctx.training.checkpoint import CheckpointError, load_checkpoint
from longctx.training.config import TrainConfig, parse_config
from longctx.training.data import ByteText, RecallTask
from longctx.training.trainer import Trainer, main, run

# A tiny, fast run: the tiny preset at 64 tokens, 4 pairs.
TINY = [
    "--preset", "tiny", "--micro-batch-size", "4", "--num-pairs", "4", "--num-queries", "4",
    "--num-keys", "16", "--num-values", "16", "--eval-iters", "1", "--quiet", "--device", "cpu",
]  # fmt: skip


def losses(save: Path) -> list[float]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


# -- configuration --------------------------------------------------------------------------------------------


def test_yaml_accepts_nemo_and_megatron_names_and_flags_win(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "preset: tiny\n"
        "num_layers: 4\n"
        "activations_checkpoint_granularity: full\n"
        "activations_checkpoint_method: block\n"
        "activations_checkpoint_num_layers: 2\n"
        "num_query_groups: 1\n"
        "max_steps: 7\n"
        "lr: 0.001\n"
    )
    cfg = parse_config(["--config", str(cfg_file), "--lr", "0.002"])
    m = cfg.model_config()
    assert (m.num_layers, m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == (
        4,
        "full",
        "block",
        2,
    )
    assert m.num_query_groups == 1 and cfg.train_iters == 7 and cfg.lr == 0.002
    # NeMo's nesting (model:/trainer:) is flattened
    nested = tmp_path / "n.yaml"
    nested.write_text("model:\n  activations_checkpoint_granularity: selective\ntrainer:\n  max_steps: 3\n")
    cfg = parse_config(["--config", str(nested), "--preset", "tiny"])
    assert cfg.model_config().recompute_granularity == "selective" and cfg.train_iters == 3


def test_unknown_yaml_keys_are_named(tmp_path, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text("num_layer: 3\nfoo_bar: 1\nlr: 0.1\n")
    with pytest.raises(ValueError, match=r"'num_layer' \(did you mean 'num_layers'\?\).*'foo_bar'"):
        parse_config(["--config", str(f)])
    assert main(["--config", str(f)]) == 2
    assert "foo_bar" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--num-query-groups", "3"], r"valid values are .*\[1, 2, 4\]"),
        (["--recompute-granularity", "full"], "needs recompute_method"),
        (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "must be None"),
        (
            ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"],
            r"\[1, num_layers=2\]",
        ),  # fmt: skip
    ],
)
def test_invalid_model_settings_are_errors(flags, match, capsys):
    with pytest.raises(ValueError, match=match):
        parse_config(["--preset", "tiny", *flags])
    assert main(["--preset", "tiny", *flags]) == 2


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"micro_batch_size": 0}, ValueError, "micro_batch_size must be >= 1"),
        ({"cp_method": "mesh"}, ValueError, r"cp_method must be one of \['auto', 'ring', .*'ulysses_ring', 'p2p'\]"),
        ({"preset": "huge"}, ValueError, "unknown preset 'huge'"),
        ({"lr": "fast"}, TypeError, "lr must be a float"),
        ({"train_iters": 2.5}, TypeError, "train_iters must be an int"),
        ({"model": {"num_layers": 0}}, ValueError, "num_layers"),
    ],
)
def test_train_config_names_a_bad_setting(kw, error, match):
    with pytest.raises(error, match=match):
        TrainConfig(**kw)


def test_yaml_exponents_without_a_dot_are_floats(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: tiny\nlr: 3e-4\nsave: none\n")  # YAML 1.1 reads 3e-4 as a string
    cfg = parse_config(["--config", str(f)])
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float) and cfg.save is None


def test_compile_ahead_is_on_by_default_and_can_be_turned_off(capsys):
    assert parse_config([]).compile_ahead is True
    assert parse_config(["--compile-ahead", "false"]).compile_ahead is False
    # on the CPU there is nothing to compile: the run prints no compile line
    run(TrainConfig(preset="tiny", train_iters=1, eval_iters=0, save=None, device="cpu"))
    assert "compiled ahead" not in capsys.readouterr().out


def test_dp_shard_is_fsdp2_by_default_and_replicate_excludes_offloaded_parameters():
    assert parse_config([]).dp_shard == "fsdp2"
    assert parse_config(["--dp-shard", "replicate"]).dp_shard == "replicate"
    with pytest.raises(ValueError, match=r"dp_shard must be one of \['fsdp2', 'replicate'\], got 'ddp'"):
        parse_config(["--dp-shard", "ddp"])
    with pytest.raises(ValueError, match="drop one of --dp-shard replicate and --offload-params"):
        parse_config(["--dp-shard", "replicate", "--offload-params", "true"])


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    cfg = parse_config(["--config", str(path)])
    assert cfg.train_iters > 0 and cfg.model_config().seq_length > 0


# -- data -----------------------------------------------------------------------------------------------------


def test_recall_task_layout_and_held_out_split():
    task = RecallTask(seq_length=64, vocab_size=48, num_pairs=6, num_queries=4, num_keys=16, num_values=16)
    b = task.batch(3, step=0, seed=1)
    assert b.inputs.shape == b.labels.shape == b.loss_mask.shape == (3, 64)
    assert torch.equal(b.inputs[:, 1:], b.labels[:, :-1])
    assert int(b.loss_mask.sum()) == 3 * 4
    for i in range(3):
        seq = torch.cat([b.inputs[i], b.labels[i, -1:]])
        qpos = b.loss_mask[i].nonzero().flatten()
        for p in qpos.tolist():  # every queried key appears once in the context, followed by its value
            key, value = int(seq[p]), int(seq[p + 1])
            ctx = (seq[: 65 - 8] == key).nonzero().flatten()
            assert len(ctx) == 1 and int(seq[ctx[0] + 1]) == value and key < 16 <= value < 32
    assert torch.equal(task.batch(3, 5, 1).inputs, task.batch(3, 5, 1).inputs)  # a pure function of (seed, step)
    assert not torch.equal(task.batch(3, 0, 1, "eval").inputs, b.inputs)
    with pytest.raises(ValueError, match="too short"):
        RecallTask(seq_length=16, num_pairs=8, num_queries=8)


def test_byte_text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(bytes(range(256)) * 4)
    data = ByteText(f, seq_length=16)
    b = data.batch(2, 0, 0)
    assert b.inputs.shape == (2, 16) and torch.equal(b.inputs[:, 1:], b.labels[:, :-1]) and b.loss_mask is None
    with pytest.raises(ValueError, match="needs at least"):
        ByteText(f, seq_length=1000)


# -- training -------------------------------------------------------------------------------------------------


def test_smoke_auto_backend_with_recompute(tmp_path, capsys):
    save = tmp_path / "run"
    argv = TINY + ["--train-iters", "4", "--save", str(save), "--attention-backend", "auto"]
    argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    assert main([a for a in argv if a != "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "peak" in out and "recall accuracy" in out
    assert len(losses(save)) == 4
    state = load_checkpoint(save / "checkpoint.pt")
    assert state["step"] == 4 and state["model_config"]["recompute_granularity"] == "full"


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    common = TINY + ["--train-iters", "6", "--hidden-dropout", "0.1", "--attention-backend", "math"]
    full = run(parse_config(common + ["--save", str(tmp_path / "a")]))
    assert main(common + ["--save", str(tmp_path / "b"), "--halt-after", "3"]) == 0
    assert load_checkpoint(tmp_path / "b" / "checkpoint.pt")["step"] == 3
    resumed = run(parse_config(common + ["--save", str(tmp_path / "b"), "--resume"]))
    assert resumed.first_step == 3 and len(resumed.losses) == 3
    assert full.losses[3:] == resumed.losses  # exactly, dropout included
    assert losses(tmp_path / "b") == full.losses


def test_train_step_by_hand_equals_run():
    cfg = parse_config(TINY + ["--train-iters", "3", "--save", "none", "--attention-backend", "math"])
    trainer = Trainer(cfg)
    by_hand = [trainer.train_step(step)[0] for step in range(3)]
    assert by_hand == run(cfg).losses


def test_byte_level_training_on_a_text_file(tmp_path, capsys):
    f = tmp_path / "text.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(TINY + ["--data", str(f), "--train-iters", "2", "--save", "none"]) == 0


# -- checkpoints ----------------------------------------------------------------------------------------------


def test_corrupt_checkpoint_is_a_clear_error_and_stays_untouched(tmp_path, capsys):
    save = tmp_path / "run"
    save.mkdir()
    bad = save / "checkpoint.pt"
    bad.write_bytes(b"not a zip file at all")
    with pytest.raises(CheckpointError, match="corrupt or not a longctx checkpoint"):
        load_checkpoint(bad)
    assert main(TINY + ["--train-iters", "2", "--save", str(save), "--resume"]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert bad.read_bytes() == b"not a zip file at all"
    torch.save({"weights": torch.zeros(2)}, save / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a longctx checkpoint"):
        load_checkpoint(save / "foreign.pt")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(save / "missing.pt")


def test_mismatched_checkpoint_names_the_fields(tmp_path, capsys):
    save = tmp_path / "run"
    assert main(TINY + ["--train-iters", "1", "--save", str(save)]) == 0
    assert main(TINY + ["--train-iters", "2", "--save", str(save), "--resume", "--hidden-size", "32"]) == 2
    assert "hidden_size: 64 -> 32" in capsys.readouterr().err
    # how the model is computed may change: recomputation and the attention backend
    argv = ["--recompute-granularity", "selective", "--attention-backend", "math"]
    assert main(TINY + ["--train-iters", "2", "--save", str(save), "--resume", *argv]) == 0


def test_a_failed_save_never_overwrites_the_last_good_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    ckpt_mod.save_checkpoint(path, {"step": 1, "model": {}, "optimizer": {}, "rng": {}, "model_config": {}})
    good = path.read_bytes()

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt_mod.save_checkpoint(path, {"step": 2, "model": {}, "optimizer": {}, "rng": {}, "model_config": {}})
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert load_checkpoint(path)["step"] == 1


def test_cli_reaches_train(tmp_path):
    from longctx.cli.main import main as cli_main

    assert cli_main(["train", *TINY, "--train-iters", "1", "--save", "none"]) == 0


@pytest.mark.distributed
def test_context_parallel_training_matches_one_process(tmp_path):
    # torchrun --nproc-per-node 2 -m longctx train --context-parallel 2: gloo on the CPU, ring attention over the
    # tiled launchers, zigzag shards; the logged losses equal the single-process run's.
    import os
    import subprocess
    import sys

    argv = TINY + ["--train-iters", "3", "--attention-backend", "tiled"]
    run(parse_config(argv + ["--save", str(tmp_path / "one")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "longctx", "train"]
    cmd += argv + ["--context-parallel", "2", "--save", str(tmp_path / "cp")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch.testing.assert_close(losses(tmp_path / "cp"), losses(tmp_path / "one"), rtol=1e-5, atol=1e-6)


def test_progress_rate_is_over_the_recent_steps():
    """The progress line's throughput: the last steps' rate, not the mean since step 1 (slow first steps fade
    out after the window), and an evaluation's time is left out."""
    from longctx.training.metrics import RecentRate

    r = RecentRate(window=3)
    r.mark(0, 0.0)
    assert r.steps_per_second() == 0.0
    r.mark(1, 10.0)  # a slow first step (compiling)
    assert r.steps_per_second() == 0.1
    for step in range(2, 6):
        r.mark(step, 10.0 + (step - 1))  # then one step a second
    assert r.steps_per_second() == 1.0
    r.skip(30.0)  # an evaluation after step 5
    r.mark(6, 10.0 + 5 + 30.0)
    assert r.steps_per_second() == 1.0


def test_the_default_learning_rate_follows_the_models_width():
    """Unset, lr is the published rate for the model's width (the demo models keep 3e-3) and min_lr a tenth of it;
    an lr below the demo's min_lr no longer needs min_lr set with it."""
    from longctx.training.config import TrainConfig, default_lr

    tiny = TrainConfig(preset="tiny")
    assert (tiny.lr, tiny.min_lr) == pytest.approx((3e-3, 3e-4), rel=1e-12)
    big = TrainConfig(preset="llama-8b")
    assert (big.lr, big.min_lr) == pytest.approx((1.5e-4, 1.5e-5), rel=1e-12)
    assert TrainConfig(preset="llama-350m").lr == 3e-4 and TrainConfig(preset="gpt2-small").lr == 6e-4
    assert [default_lr(h) for h in (64, 512, 768, 1024, 3072, 4096, 8192)] == [3e-3, 3e-3, 6e-4, 3e-4, 3e-4, 1.5e-4,
                                                                               1.5e-4]  # fmt: skip
    low = TrainConfig(preset="tiny", lr=1e-4)
    assert low.min_lr == pytest.approx(1e-5)
    with pytest.raises(ValueError, match=r"min_lr \(0.01\) must be <= lr \(0.003\)"):
        TrainConfig(preset="tiny", min_lr=1e-2)


def test_the_default_micro_batch_is_the_demos_32_or_one_long_sequence():
    """Unset, micro_batch_size is the recall demo's 32 sequences for the demo models and one sequence for the wide
    presets (an 8B at 32K tokens takes one a step); set, it is kept."""
    from longctx.training.config import TrainConfig

    assert TrainConfig(preset="tiny").micro_batch_size == 32
    assert TrainConfig(preset="llama-8b").micro_batch_size == 1
    assert TrainConfig(preset="llama-350m", micro_batch_size=4).micro_batch_size == 4
