"""`longctx train` never loses work and never trains garbage silently: signals, run folders, configuration types and
ranges, non-finite steps, checksummed checkpoints, the CPU thread count, flag help and the loss plot."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from longctx.training.checkpoint import CheckpointError, load_checkpoint, save_training_state
from longctx.training.config import TrainConfig, build_parser, parse_config
from longctx.training.trainer import Trainer, cpu_threads, main

TINY = [
    "--preset", "tiny", "--micro-batch-size", "2", "--num-keys", "16", "--num-values", "16", "--eval-iters", "1",
    "--quiet", "--device", "cpu", "--attention-backend", "math",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    # The Trainer sets the process's thread count for small CPU models; other tests keep theirs.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


# -- configuration: every field typed and ranged, YAML and flags alike -------------------------------------------


@pytest.mark.parametrize(
    "yaml_line, error, match",
    [
        ('train_iters: "5"', TypeError, r"c\.yaml': train_iters must be an int .*got '5' \(str\).*without quotes"),
        ("micro_batch_size: 2.5", TypeError, r"micro_batch_size must be an int .*got 2\.5 \(float\)"),
        ("device: gpu", ValueError, r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu' \(use 'cuda'"),
        ("train_iters: -5", ValueError, r"train_iters must be >= 1, got -5"),
        ('share_embeddings_and_output_weights: "no"', TypeError, r"share_embeddings_and_output_weights must be a bool"),
        ("lr: fast", TypeError, r"lr must be a float .*got 'fast' \(str\)"),
        ("lr: .nan", ValueError, r"lr must be a finite number"),
        ("num_layers: [2]", TypeError, r"num_layers must be an int .*got \[2\] \(list\)"),
        ("cp_method: 3", TypeError, r"cp_method must be a str, got 3 \(int\)"),
    ],
)
def test_yaml_values_of_the_wrong_type_or_range_name_the_key(tmp_path, capsys, yaml_line, error, match):
    f = tmp_path / "c.yaml"
    f.write_text(f"preset: tiny\n{yaml_line}\n")
    with pytest.raises(error, match=match):
        parse_config(["--config", str(f)])
    assert main(["--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and yaml_line.split(":")[0] in err


@pytest.mark.parametrize(
    "yaml_line, hint",
    [('lr: "fast"', False), ('lr: "0.5"', True), ('train_iters: "5x"', False), ('train_iters: "5"', True)],
)
def test_the_unquote_hint_only_where_the_unquoted_text_is_valid(tmp_path, yaml_line, hint):
    f = tmp_path / "c.yaml"
    f.write_text(f"preset: tiny\n{yaml_line}\n")
    with pytest.raises(TypeError) as exc:
        parse_config(["--config", str(f)])
    assert ("without quotes" in str(exc.value)) == hint, str(exc.value)


def test_scientific_notation_is_a_number_in_yaml_and_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: tiny\nlr: 3e-4\nmin_lr: 1e-5\ntrain_iters: 1e3\nweight_decay: 1.0e-2\n")
    cfg = parse_config(["--config", str(f)])
    assert (cfg.lr, cfg.min_lr, cfg.train_iters, cfg.weight_decay) == (3e-4, 1e-5, 1000, 0.01)
    cfg = parse_config(["--lr", "3e-4", "--train-iters", "2e3", "--bf16", "no", "--num-query-groups", "none"])
    assert (cfg.lr, cfg.train_iters, cfg.bf16) == (3e-4, 2000, False) and cfg.model["num_query_groups"] is None


@pytest.mark.parametrize(
    "flags, error, match",
    [
        (["--micro-batch-size", "0"], ValueError, r"micro_batch_size must be >= 1, got 0"),
        (["--train-iters", "-5"], ValueError, r"train_iters must be >= 1, got -5"),
        (["--train-iters", "2.5"], TypeError, r"--train-iters must be an int .*got '2\.5'"),
        (["--lr", "0"], ValueError, r"lr must be > 0"),
        (["--lr", "1e-3", "--min-lr", "1e-2"], ValueError, r"min_lr \(0\.01\) must be <= lr \(0\.001\)"),
        (["--adam-beta2", "1.0"], ValueError, r"adam_beta2 must be in \[0, 1\)"),
        (["--log-interval", "0"], ValueError, r"log_interval must be >= 1"),
        (["--seed", "-1"], ValueError, r"seed must be >= 0"),
        (["--bf16", "maybe"], TypeError, r"--bf16 must be a bool .*got 'maybe'"),
        (["--num-layers", "two"], TypeError, r"--num-layers must be an int"),
        (["--device", "gpu"], ValueError, r"use 'cuda'"),
        (["--on-nonfinite", "ignore"], ValueError, r"on_nonfinite must be one of \['stop', 'skip'\]"),
        (["--resume", "--overwrite"], ValueError, r"resume and overwrite exclude each other"),
    ],
)
def test_flags_are_checked_like_yaml(flags, error, match, capsys):
    with pytest.raises(error, match=match):
        parse_config(TINY + flags)
    assert main(TINY + flags) == 2  # nothing trained, a clear message
    assert "Traceback" not in capsys.readouterr().err


def test_python_config_is_checked_too():
    with pytest.raises(TypeError, match=r"num_layers must be an int .*got '2' \(str\)"):
        TrainConfig(model={"num_layers": "2"})
    with pytest.raises(ValueError, match=r"unknown configuration key\(s\) in model: 'num_layer'"):
        TrainConfig(model={"num_layer": 2})


def test_every_train_flag_has_help_with_its_default():
    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        assert action.help, action.option_strings
        if action.option_strings[0] not in ("--steps", "--batch-size"):
            assert "(default: " in action.help, action.option_strings
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert "(default: 1500)" in helps["--train-iters"] and "(default: 32 for the demo models" in helps[
        "--micro-batch-size"]  # fmt: skip
    assert "(default: by the model's width" in helps["--lr"] and helps["--lr"].count("default") == 1
    assert "(default: runs/recall)" in helps["--save"] and "(default: 2)" in helps["--num-layers"]  # demo's
    assert "metrics.jsonl" in parser.epilog and "--overwrite" in parser.epilog


# -- the run folder belongs to one run ---------------------------------------------------------------------------


def test_a_fresh_run_refuses_a_folder_with_another_run(tmp_path, capsys):
    save = tmp_path / "run"
    assert main(TINY + ["--train-iters", "3", "--save", str(save)]) == 0
    before = (save / "checkpoint.pt").read_bytes()
    assert main(TINY + ["--train-iters", "2", "--save", str(save)]) == 2
    err = capsys.readouterr().err
    assert f"--save {save} holds another run" in err and "--resume" in err and "--overwrite" in err
    assert (save / "checkpoint.pt").read_bytes() == before and len(rows(save)) == 3
    assert main(TINY + ["--train-iters", "2", "--save", str(save), "--overwrite"]) == 0
    assert [r["step"] for r in rows(save)] == [1, 2] and load_checkpoint(save / "checkpoint.pt")["step"] == 2


def test_metrics_hold_each_step_once_after_a_resume(tmp_path):
    save = tmp_path / "run"
    assert main(TINY + ["--train-iters", "6", "--save", str(save), "--halt-after", "3"]) == 0
    with open(save / "metrics.jsonl", "a") as f:  # steps an interrupted run did after its last checkpoint
        f.write(json.dumps({"step": 4, "loss": 9.0, "lr": 0.1}) + "\n" + '{"step": 5, "lo')
    assert main(TINY + ["--train-iters", "6", "--save", str(save), "--resume"]) == 0
    steps = [r["step"] for r in rows(save)]
    assert steps == [1, 2, 3, 4, 5, 6] and all(r["loss"] != 9.0 for r in rows(save))


def test_halt_after_a_step_already_past_says_nothing_was_trained(tmp_path, capsys):
    save = tmp_path / "run"
    assert main(TINY + ["--train-iters", "6", "--save", str(save), "--halt-after", "4"]) == 0
    capsys.readouterr()
    assert main(TINY + ["--train-iters", "6", "--save", str(save), "--resume", "--halt-after", "2"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "nothing trained: the run is already at step 4, past --halt-after 2" in text, text
    assert "halted after step 2" not in text
    assert [r["step"] for r in rows(save)] == [1, 2, 3, 4]


# -- SIGINT / SIGTERM: a checkpoint, where it is, the conventional exit code --------------------------------------


def _signal_at(monkeypatch, at_step: int, sig: int, times: int = 1) -> None:
    real = Trainer.train_step

    def step(self, step):
        if step == at_step:
            for _ in range(times):  # delivered to the handler between two bytecodes of this step
                os.kill(os.getpid(), sig)
        return real(self, step)

    monkeypatch.setattr(Trainer, "train_step", step)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_step_and_writes_a_checkpoint(tmp_path, monkeypatch, capsys, sig, code):
    save = tmp_path / "run"
    _signal_at(monkeypatch, 4, sig)  # long before the first periodic checkpoint (save_interval 500)
    assert main(TINY + ["--train-iters", "50", "--save", str(save)]) == code
    err = capsys.readouterr().err
    assert f"{signal.Signals(sig).name}: stopped after step 5" in err
    assert f"the checkpoint {save / 'checkpoint.pt'} (step 5) is intact; continue with --resume" in err
    assert load_checkpoint(save / "checkpoint.pt")["step"] == 5 and [r["step"] for r in rows(save)] == [1, 2, 3, 4, 5]
    monkeypatch.undo()
    assert main(TINY + ["--train-iters", "7", "--save", str(save), "--resume"]) == 0
    assert [r["step"] for r in rows(save)] == list(range(1, 8))


def test_a_signal_without_a_save_folder_promises_nothing(monkeypatch, capsys):
    _signal_at(monkeypatch, 1, signal.SIGTERM)
    assert main(TINY + ["--train-iters", "50", "--save", "none"]) == 143
    assert "stopped after step 2; no checkpoint: --save is none" in capsys.readouterr().err


def test_a_second_signal_abandons_the_step_and_names_only_a_checkpoint_that_exists(tmp_path, monkeypatch, capsys):
    save = tmp_path / "run"
    _signal_at(monkeypatch, 2, signal.SIGTERM, times=2)
    assert main(TINY + ["--train-iters", "50", "--save", str(save)]) == 143
    err = capsys.readouterr().err
    assert "stopped before a step could end; no checkpoint was written" in err
    assert not (save / "checkpoint.pt").exists()
    monkeypatch.undo()
    assert main(TINY + ["--train-iters", "4", "--save", str(save), "--overwrite", "--save-interval", "2"]) == 0
    _signal_at(monkeypatch, 5, signal.SIGTERM, times=2)
    assert main(TINY + ["--train-iters", "8", "--save", str(save), "--resume"]) == 143
    assert "the checkpoint" in capsys.readouterr().err and load_checkpoint(save / "checkpoint.pt")["step"] == 4


# -- non-finite steps, checksums --------------------------------------------------------------------------------


def _poison(monkeypatch, at_step: int, where: str) -> None:
    real = Trainer.forward_backward

    def fwd_bwd(self, batch):
        loss = real(self, batch)
        if self._step_now == at_step:
            if where == "loss":
                return loss * float("nan")
            next(self.model.parameters()).grad[0, 0] = float("inf")
        return loss

    real_step = Trainer.train_step

    def step(self, s):
        self._step_now = s
        return real_step(self, s)

    monkeypatch.setattr(Trainer, "forward_backward", fwd_bwd)
    monkeypatch.setattr(Trainer, "train_step", step)


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_non_finite_step_stops_the_run_naming_it(tmp_path, monkeypatch, capsys, where):
    save = tmp_path / "run"
    _poison(monkeypatch, 2, where)
    assert main(TINY + ["--train-iters", "6", "--save", str(save)]) == 1
    err = capsys.readouterr().err
    assert "step 3: the loss is" in err and "--on-nonfinite skip" in err
    assert f"the checkpoint {save / 'checkpoint.pt'} (step 2) is intact" in err
    state = load_checkpoint(save / "checkpoint.pt")
    assert state["step"] == 2 and all(torch.isfinite(t).all() for t in state["model"].values())


def test_skip_mode_skips_the_step_and_keeps_the_weights_finite(tmp_path, monkeypatch):
    save = tmp_path / "run"
    _poison(monkeypatch, 2, "loss")
    assert main(TINY + ["--train-iters", "5", "--save", str(save), "--on-nonfinite", "skip"]) == 0
    r = rows(save)
    assert r[2]["step"] == 3 and r[2]["loss"] is None and "non-finite" in r[2]["skipped"]
    assert all(math.isfinite(x["loss"]) for i, x in enumerate(r) if i != 2)
    assert load_checkpoint(save / "checkpoint.pt")["step"] == 5


def test_a_non_finite_state_is_never_saved(tmp_path):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    path = tmp_path / "checkpoint.pt"
    save_training_state(path, step=1, model=model, optimizer=opt, model_config={}, train_config={})
    good = path.read_bytes()
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    with pytest.raises(CheckpointError, match=r"refusing to write .* step 2: NaN or infinity in model/weight"):
        save_training_state(path, step=2, model=model, optimizer=opt, model_config={}, train_config={})
    assert path.read_bytes() == good


def _flip_a_byte_inside_the_largest_tensor(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    off = info.header_offset  # local file header: 30 bytes, the name, the extra field, then the stored bytes
    start = (
        off
        + 30
        + int.from_bytes(raw[off + 26 : off + 28], "little")
        + int.from_bytes(raw[off + 28 : off + 30], "little")
    )
    raw[start + info.file_size // 2] ^= 0x01  # the lowest mantissa bit: a finite, plausible weight
    path.write_bytes(bytes(raw))


def test_flipped_bytes_in_a_checkpoint_are_a_clear_error(tmp_path, capsys):
    save = tmp_path / "run"
    assert main(TINY + ["--train-iters", "2", "--save", str(save)]) == 0
    _flip_a_byte_inside_the_largest_tensor(save / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"is corrupt: the checksum of '(model|optimizer)/.*' does not match"):
        load_checkpoint(save / "checkpoint.pt")
    assert main(TINY + ["--train-iters", "4", "--save", str(save), "--resume"]) == 2
    assert "checksum" in capsys.readouterr().err


# -- CPU threads, the loss plot ----------------------------------------------------------------------------------


def test_small_cpu_models_train_on_one_thread(monkeypatch):
    cfg = parse_config(TINY + ["--train-iters", "1", "--save", "none"])
    assert cpu_threads(cfg.model_config()) == 1
    assert cpu_threads(parse_config(["--preset", "gpt2-small"]).model_config()) is None
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    Trainer(cfg)
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    Trainer(cfg)
    assert torch.get_num_threads() == 2  # the user's OMP_NUM_THREADS decides


def test_a_loss_curve_is_written_next_to_the_metrics(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    save = tmp_path / "run"
    assert main(TINY + ["--train-iters", "3", "--save", str(save)]) == 0
    png = save / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main(TINY + ["--train-iters", "3", "--save", str(tmp_path / "b")]) == 0
    assert not (tmp_path / "b" / "loss.png").exists()
    loud = [a for a in TINY if a != "--quiet"]
    assert main(loud + ["--train-iters", "1", "--save", str(tmp_path / "c")]) == 0
    assert "note: matplotlib is not installed" in capsys.readouterr().out
