"""Parameters, gradients and AdamW states in host memory (`longctx.distributed.offload`, ``offload_params``) on the
CPU: the units FSDP2 shards, the host optimizer, training equal to the plain model's, the trainer's run and resume,
and the planner's two memories. The GPU side (pinned states, the units in flight, the 8B rows) is in
tests/gpu/test_offload_gpu.py and benchmarks/results/memory_H200_llama-8b_offload_*.md."""

from __future__ import annotations

import json
import math
from unittest import mock

import pytest
import torch
from torch import nn

from longctx.distributed.mesh import decoder_units
from longctx.distributed.offload import host_adamw, offload_model
from longctx.memory import model as memory_model
from longctx.memory.plan import format_plan, parameter_count, plan
from longctx.models.gpt import GPT, GPTConfig

TINY = dict(vocab_size=128, seq_length=64, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=128, attention_backend="tiled")  # fmt: skip
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def test_presets_have_the_llama_shapes():
    assert parameter_count(GPTConfig.preset("llama-8b"))[0] == 8_030_261_248  # Llama-3.1-8B
    assert parameter_count(GPTConfig.preset("llama-3b"))[0] == 3_212_749_824  # Llama-3.2-3B (tied)


def test_decoder_units_of_a_gpt():
    untied = GPT(GPTConfig(**TINY, share_embeddings_and_output_weights=False))
    assert decoder_units(untied) == [untied.embedding, *untied.layers]
    tied = GPT(GPTConfig(**TINY))
    assert decoder_units(tied) == list(tied.layers)  # the tied embedding stays in the root with the output


def test_decoder_units_of_a_transformers_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    assert decoder_units(model) == [model.model.embed_tokens, *model.model.layers]
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": True}))
    assert decoder_units(tied) == list(tied.model.layers)


def test_decoder_units_refuse_other_models():
    with pytest.raises(TypeError, match="offload_params shards a model layer by layer.*got Linear"):
        decoder_units(nn.Linear(4, 4))


def test_host_adamw_steps_only_what_trains_and_only_on_the_host():
    model = GPT(GPTConfig(**TINY))
    model.layers[0].requires_grad_(False)
    opt = host_adamw(model, lr=1e-3)
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(p) in stepped for p in model.layers[0].parameters())
    assert all(id(p) in stepped for p in model.layers[1].parameters())
    with torch.device("meta"):
        elsewhere = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="host_adamw steps parameters in host memory.*offload_model"):
        host_adamw(elsewhere, lr=1e-3)


def _train(model: GPT, opt, steps: int = 3) -> list[float]:
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_length"]), generator=gen)
        loss = model(x, labels=x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_offloaded_training_equals_the_plain_model():
    cfg = GPTConfig(**TINY, share_embeddings_and_output_weights=False, **FULL)
    torch.manual_seed(0)
    plain = GPT(cfg)
    torch.manual_seed(0)
    sharded = GPT(cfg)
    offload_model(sharded)  # on the CPU: computes in the parameters' dtype
    opt = host_adamw(sharded, lr=1e-2, weight_decay=0.0)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    assert _train(sharded, opt) == pytest.approx(_train(plain, ref), rel=1e-5)
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-4, atol=1e-5, msg=name)


def _run(tmp_path, name: str, **kw):
    from longctx.training.config import TrainConfig
    from longctx.training.trainer import Trainer

    cfg = TrainConfig(preset="tiny", train_iters=4, micro_batch_size=2, eval_iters=0, quiet=True,
                      save=str(tmp_path / name), **kw)  # fmt: skip
    trainer = Trainer(cfg)
    return trainer, trainer.train()


def test_trainer_offload_params_trains_resumes_and_matches(tmp_path):
    plain, plain_run = _run(tmp_path, "plain")
    off, off_run = _run(tmp_path, "off", offload_params=True)
    assert off.dp_strategy == "fsdp2-offload" and plain.dp_strategy is None
    assert off_run.losses == pytest.approx(plain_run.losses, rel=1e-5)
    _, first = _run(tmp_path, "halted", offload_params=True, halt_after=2)
    _, rest = _run(tmp_path, "halted", offload_params=True, resume="auto")
    assert first.losses + rest.losses == pytest.approx(off_run.losses, rel=1e-6)
    # units kept on the GPU (here: the output layer and the first layer of the tied tiny model): the same run,
    # and its checkpoint resumes in a run that offloads every unit
    res, res_run = _run(tmp_path, "resident", offload_params=True, offload_resident_units=2, halt_after=2)
    assert res.model._longctx_resident_units == 2
    _, res_rest = _run(tmp_path, "resident", offload_params=True, resume="auto")
    assert res_run.losses + res_rest.losses == pytest.approx(off_run.losses, rel=1e-5)
    with pytest.raises(ValueError, match="offload_resident_units=2 keeps units of offloaded states.*--offload-params"):
        _run(tmp_path, "bad", offload_resident_units=2)


def test_a_checkpoint_resumes_with_and_without_offload(tmp_path):
    """A run's checkpoint continues under the other setting to the losses of an uninterrupted run: an offloaded
    run's sharded folder in a plain process, and a plain run's single file in an offloaded one (every rank takes its
    shard of the whole state)."""
    _, whole = _run(tmp_path, "whole")
    _, off_first = _run(tmp_path, "off", offload_params=True, halt_after=2)
    _, plain_rest = _run(tmp_path, "plain-rest", resume=str(tmp_path / "off" / "checkpoint"))
    assert off_first.losses + plain_rest.losses == pytest.approx(whole.losses, rel=1e-5)
    _, plain_first = _run(tmp_path, "plain", halt_after=2)
    _, off_rest = _run(tmp_path, "off-rest", offload_params=True, resume=str(tmp_path / "plain" / "checkpoint.pt"))
    assert plain_first.losses + off_rest.losses == pytest.approx(whole.losses, rel=1e-5)


def test_the_trainer_hides_the_host_step_behind_the_next_forward_to_the_bit(tmp_path):
    """An offloaded run steps the host's AdamW behind the next forward (`OverlappedHostStep`): its losses, final
    weights and AdamW states are those of the step taken in place, and the checkpoint it writes at the end holds
    the last step's weights (the trainer waits for the step before writing)."""
    from longctx.distributed.offload import OverlappedHostStep

    with mock.patch("longctx.distributed.offload.OverlappedHostStep",
                    lambda *a, **k: OverlappedHostStep(*a, **k, background=False)):  # fmt: skip
        inline, inline_run = _run(tmp_path, "inline", offload_params=True, clip_grad=0.05)
    assert not inline.host_step.background
    overlapped, overlapped_run = _run(tmp_path, "overlapped", offload_params=True, clip_grad=0.05)
    assert overlapped.host_step.background
    # the summary's host step: each step's own time and what the next forward waited for it
    times = overlapped.host_step_times  # steps 1-3 (the fourth's is not followed by a step); the first at once
    assert len(times) == 3 and times[0][0] == times[0][1] > 0 and all(t > 0 and w >= 0 for t, w in times)
    assert "host step" in overlapped._summary(overlapped_run, {}, 4)
    assert overlapped_run.losses == inline_run.losses
    for (name, p), q in zip(overlapped.model.named_parameters(), inline.model.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        assert torch.equal(overlapped.optimizer.state[p]["exp_avg_sq"].full_tensor(),
                           inline.optimizer.state[q]["exp_avg_sq"].full_tensor()), name  # fmt: skip
    from longctx.training.config import TrainConfig
    from longctx.training.trainer import Trainer

    resumed = Trainer(TrainConfig(preset="tiny", train_iters=4, micro_batch_size=2, eval_iters=0, quiet=True,
                                  save=str(tmp_path / "overlapped"), offload_params=True, clip_grad=0.05,
                                  resume="auto"))  # fmt: skip
    assert resumed.start_step == 4
    for (name, p), q in zip(resumed.model.named_parameters(), overlapped.model.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name


def test_host_memory_budget_needs_a_memory_budget():
    from longctx.training.config import TrainConfig, parse_config

    with pytest.raises(ValueError, match="host_memory_budget .* pass --memory-budget"):
        TrainConfig(host_memory_budget="100GiB")
    with pytest.raises(ValueError, match="host_memory_budget"):
        TrainConfig(memory_budget="10GiB", host_memory_budget="lots")
    cfg = parse_config(["--offload-params", "true", "--memory-budget", "10GiB", "--host-memory-budget", "1TiB"])
    assert cfg.offload_params and cfg.host_memory_budget == "1TiB"


# -- the planner's two memories --------------------------------------------------------------------------------


def test_offloaded_step_memory_moves_the_states_to_the_host():
    cfg = GPTConfig(**TINY, **FULL)
    n = parameter_count(cfg)[0]
    gpu = memory_model.step_memory(cfg, seq_length=256)
    off = memory_model.step_memory(cfg, seq_length=256, offload_params=True)
    shards = memory_model.step_memory(cfg, seq_length=256, offload_params=True, shards=4)
    assert off.optimizer_states == 0 and off.gradients == 0 and off.host_states == 16 * n
    assert shards.host_states == math.ceil(16 * n / 4)
    assert off.checkpoints * 2 == gpu.checkpoints  # FSDP2's bf16 units: a bf16 residual stream
    assert gpu.host_total == memory_model.HOST_OVERHEAD_BYTES  # nothing offloaded: the process itself
    # 16 bytes a parameter, the pinned weight and gradient rounded up to powers of two
    assert off.host_states == memory_model.offloaded_state_bytes(cfg, 1) >= 16 * n
    assert off.host_total == off.host_states + memory_model.HOST_OVERHEAD_BYTES
    from longctx.memory.plan import host_need

    # the planner's host bytes without a trace are the trace's, with and without offloaded checkpoints
    for c in (cfg, cfg.replace(cpu_offloading=True)):
        for o, ranks in ((False, 1), (True, 1), (True, 4)):
            traced = memory_model.step_memory(c, seq_length=256, offload_params=o, shards=ranks).host_total
            assert host_need(c, o, ranks, 1, 256) == ranks * traced, (c.cpu_offloading, o, ranks)
    with pytest.raises(ValueError, match="shards must be a positive int"):
        memory_model.step_memory(cfg, seq_length=256, offload_params=True, shards=0)


def test_the_8b_plan_offloads_and_says_which_memory_binds():
    p = plan(GPTConfig.preset("llama-8b"), seq_length=32768, budget="78GiB", host_budget="400GiB")
    assert p.offload_params and p.memory.total <= 78 << 30
    assert p.memory.host_total <= 400 << 30 and p.binds == "GPU"
    text = format_plan(p)
    assert "predicted host peak" in text and "binds: GPU" in text and "| offload_params | True |" in text
    # the GPU's room beside the activations holds units' states: the output layer, the embedding and 15 layers
    k = p.resident_units
    assert k > 2 and f"| resident_units | {k} (the output layer, the embedding, {k - 2} layers) |" in text
    assert _resident_limit(p, 78 << 30) == k  # the most that fit
    assert p.memory.total + p.memory.host_total < memory_model.step_memory(
        p.config.replace(seq_length=32768), seq_length=32768, offload_params=True
    ).host_total + (78 << 30)
    tight = plan(GPTConfig.preset("llama-8b"), seq_length=32768, budget="78GiB", host_budget="145GiB",
                 offload_params=True, resident_units=0)  # fmt: skip
    assert tight.binds == "host" and tight.resident_units == 0


def _resident_limit(p, budget: int) -> int:
    """The most resident units whose prediction fits ``budget`` on plan ``p``'s settings (what the planner picks)."""
    c, S = p.config, p.memory.seq_length
    k = 0
    while (
        k < memory_model.resident_units_of(c)
        and memory_model.step_memory(c, seq_length=S, offload_params=True, resident_units=k + 1).total <= budget
    ):
        k += 1
    return k


def test_a_short_host_is_named_with_what_is_missing():
    with pytest.raises(ValueError, match=r"host .* GiB \(budget 100\.00 GiB\); host is short by .* GiB"):
        plan(GPTConfig.preset("llama-8b"), seq_length=32768, budget="78GiB", host_budget="100GiB",
             offload_params=True, resident_units=0)  # fmt: skip
    # the GPU holds what the host cannot: the fewest resident units the host needs, then as many as the GPU holds
    fits = plan(GPTConfig.preset("llama-8b"), seq_length=32768, budget="78GiB", host_budget="60GiB")
    assert fits.memory.host_total <= 60 << 30 and fits.memory.total <= 78 << 30
    assert _resident_limit(fits, 78 << 30) == fits.resident_units
    with pytest.raises(ValueError, match=r"32 units on the GPU\)\) needs GPU .*; GPU is short by"):
        plan(GPTConfig.preset("llama-8b"), seq_length=32768, budget="78GiB", host_budget="20GiB")
    with pytest.raises(ValueError, match="resident_units=3 keeps units of offloaded states on the GPU"):
        plan(GPTConfig.preset("llama-8b"), seq_length=32768, budget="78GiB", resident_units=3)
    with pytest.raises(ValueError, match="resident_units must be an int from 0 to 34"):
        plan(GPTConfig.preset("llama-8b"), seq_length=32768, budget="78GiB", offload_params=True, resident_units=35)


def test_parallel_ranks_share_the_states_and_split_the_sequence():
    one = plan(GPTConfig.preset("llama-8b"), seq_length=65536, budget="78GiB", offload_params=True, resident_units=0)
    four = plan(GPTConfig.preset("llama-8b"), seq_length=65536, budget="78GiB", offload_params=True,
                data_parallel=2, context_parallel=2, resident_units=0)  # fmt: skip
    assert four.memory.seq_length == 32768 and four.config.seq_length == 65536
    assert four.memory.host_states == math.ceil(one.memory.host_states / 4)
    # a quarter of the states per rank: every unit stays on the GPU, sharded over the four ranks
    chosen = plan(GPTConfig.preset("llama-8b"), seq_length=65536, budget="78GiB", offload_params=True,
                  data_parallel=2, context_parallel=2)  # fmt: skip
    assert chosen.resident_units == 34 and chosen.memory.host_states == 0
    assert "optimizer states on the GPU, sharded by FSDP2 (every unit resident)" in chosen.describe()
    with pytest.raises(ValueError, match="not divisible by context_parallel=3"):
        plan(GPTConfig.preset("llama-8b"), seq_length=65536, budget="78GiB", context_parallel=3)
    with pytest.raises(ValueError, match="data_parallel must be a positive int"):
        plan(GPTConfig.preset("llama-8b"), seq_length=65536, budget="78GiB", data_parallel=0)


def test_models_that_fit_keep_their_states_on_the_gpu():
    p = plan(GPTConfig(**TINY), seq_length=256, budget="1GiB")
    assert not p.offload_params and p.memory.host_states == 0


def test_plan_cli_plans_both_memories(capsys, tmp_path):
    from longctx.memory.plan import main

    out = tmp_path / "plan.json"
    assert main(["--preset", "llama-8b", "--seq-length", "65536", "--budget", "78GiB", "--host-budget", "400GiB",
                 "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "binds: GPU" in text and "fp32 parameters, gradients, AdamW states" in text
    entry = json.loads(out.read_text())["65536"]
    k = entry["resident_units"]
    assert entry["offload_params"] is True and 2 < k < 34
    assert 16 * 8e9 * (32 - k) / 34 < entry["predicted_host_bytes"] < 16 * 8e9  # the host: the other units' states
    assert main(["--preset", "llama-8b", "--seq-length", "65536", "--budget", "78GiB", "--offload-params", "off"]) == 2
    assert "offload_params (parameters in host memory) may train longer" in capsys.readouterr().err


def test_a_memory_budget_below_the_states_offloads_them(tmp_path):
    """``--memory-budget`` under the states of the model: the plan puts them in host memory and the run trains."""
    from longctx.memory.model import CUDA_OVERHEAD_BYTES

    model = dict(num_layers=4, hidden_size=512, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=1408,
                 vocab_size=64, seq_length=64)  # fmt: skip
    cfg = GPTConfig.preset("tiny", **model)
    budget = CUDA_OVERHEAD_BYTES + 8 * parameter_count(cfg)[0]  # half the 16 bytes a parameter of the states
    trainer, result = _run(tmp_path, "planned", model=model, memory_budget=f"{budget / 2**20:.0f}MiB",
                           num_keys=8, num_values=8, num_pairs=4, num_queries=2)  # fmt: skip
    assert trainer.offload and trainer.dp_strategy == "fsdp2-offload"
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)


def test_torchtitans_name_is_accepted_in_yaml(tmp_path):
    from longctx.training.config import parse_config

    path = tmp_path / "run.yaml"
    path.write_text("enable_cpu_offload: true\npreset: tiny\n")
    assert parse_config(["--config", str(path)]).offload_params is True


def test_offloaded_states_with_offloaded_checkpoints_and_chunks():
    """The 512K plan's combination: states in host memory, every checkpoint offloaded, the MLP in sequence chunks
    (FSDP2's unit hooks around `OffloadedCheckpoint`'s replay): the same training as the plain model."""
    cfg = GPTConfig(**TINY, share_embeddings_and_output_weights=False, **FULL, cpu_offloading=True,
                    sequence_chunk_size=16)  # fmt: skip
    torch.manual_seed(0)
    plain = GPT(cfg)
    torch.manual_seed(0)
    sharded = GPT(cfg)
    offload_model(sharded)
    opt = host_adamw(sharded, lr=1e-2, weight_decay=0.0)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    assert _train(sharded, opt) == pytest.approx(_train(plain, ref), rel=1e-5)


def test_an_offload_run_the_host_cannot_hold_is_refused_before_it_starts(tmp_path):
    """Without a memory budget (no plan checks the host), an offload_params run whose host need exceeds what the
    machine has available stops with a ValueError naming both, before any state is built, instead of being killed
    by the kernel later with its work."""
    from longctx.memory.plan import host_need
    from longctx.models.gpt import PRESETS

    need = host_need(GPTConfig(**PRESETS["tiny"]), True, 1, 2, GPTConfig(**PRESETS["tiny"]).seq_length)
    short = mock.patch("longctx.layers.offload.host_memory_available", return_value=need // 2)
    with short, pytest.raises(ValueError, match=r"offload_params needs about .* GiB of host memory on this machine "
                                                r"\(1 rank\(s\).*but .* GiB is available"):  # fmt: skip
        _run(tmp_path, "short", offload_params=True)
    assert not (tmp_path / "short" / "checkpoint.pt").exists()
    with mock.patch("longctx.layers.offload.host_memory_available", return_value=need + (1 << 30)):
        off, _ = _run(tmp_path, "enough", offload_params=True)
    assert off.dp_strategy == "fsdp2-offload"


def test_offload_over_ranks_needs_a_cpu_backend():
    """Offloaded gradients are CPU DTensors: a group of NCCL alone cannot take their norm. apply_fsdp says so
    before the first step; one rank needs no collective; a group with gloo beside NCCL passes."""
    from longctx.distributed import mesh as mesh_mod

    class Mesh:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

        def get_group(self):
            return "group"

    with mock.patch.object(mesh_mod.dist, "get_backend_config", return_value="cuda:nccl"):
        with pytest.raises(ValueError, match=r"offload_params over 4 ranks.*'cuda:nccl'.*cpu:gloo,cuda:nccl"):
            mesh_mod._check_cpu_backend(Mesh(4))
        mesh_mod._check_cpu_backend(Mesh(1))
    with mock.patch.object(mesh_mod.dist, "get_backend_config", return_value="cpu:gloo,cuda:nccl"):
        mesh_mod._check_cpu_backend(Mesh(4))


def test_torchrun_on_gpus_gets_gloo_beside_nccl(monkeypatch):
    """init_distributed under torchrun on GPUs: NCCL for CUDA tensors and gloo for CPU ones (offloaded states)."""
    from longctx.distributed import model as dist_model

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with (
        mock.patch.object(dist_model.dist, "is_initialized", return_value=False),
        mock.patch.object(dist_model.torch.cuda, "is_available", return_value=True),
        mock.patch.object(dist_model.torch.cuda, "set_device") as set_device,
        mock.patch.object(dist_model.dist, "init_process_group") as init,
        mock.patch.object(dist_model.dist, "get_rank", return_value=1),
        mock.patch.object(dist_model.dist, "get_world_size", return_value=2),
    ):
        assert dist_model.init_distributed() == (1, 2, torch.device("cuda", 1))
    set_device.assert_called_once_with(1)
    init.assert_called_once_with("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", 1))


def test_the_host_step_runs_on_the_ranks_share_of_the_cores(monkeypatch):
    """torchrun starts ranks with one intra-op thread; the host AdamW step takes this rank's share of the cores
    (those it may run on over LOCAL_WORLD_SIZE) and gives the count back after the step."""
    from longctx.distributed import offload

    monkeypatch.setattr(offload.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert offload.host_thread_share() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "24")
    assert offload.host_thread_share() == 1  # never 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = nn.Linear(4, 4)
        opt = offload.host_adamw(model, lr=1e-3)
        seen = []
        opt.register_step_pre_hook(lambda *_: seen.append(torch.get_num_threads()))  # after longctx's own
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert seen == [6] and torch.get_num_threads() == 1
        with offload.host_threads() as n:
            assert n == 6 and torch.get_num_threads() == 6
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_overlapped_host_step_equals_the_plain_step_to_the_bit():
    """`OverlappedHostStep`: the AdamW step taken unit by unit in a background thread while the next forward runs
    gives bitwise the parameters and AdamW states of `optimizer.step()`, also when the background thread is slow
    (each unit's step delayed: the forward's hooks must wait for it), and its errors reach the main thread."""
    import time

    from longctx.distributed.offload import OverlappedHostStep

    cfg = GPTConfig(**TINY, share_embeddings_and_output_weights=False)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, TINY["vocab_size"], (2, TINY["seq_length"]), generator=gen) for _ in range(3)]

    def train(overlap: bool, delay: float = 0.0, resident: int = 0):
        torch.manual_seed(0)
        model = GPT(cfg)
        offload_model(model, resident_units=resident)
        opt = host_adamw(model, lr=1e-2)
        stepper = OverlappedHostStep(opt, model) if overlap else None
        if delay:
            _slow_unit_steps(stepper, lambda: time.sleep(delay))
        for i, x in enumerate(batches):
            for g in opt.param_groups:
                g["lr"] = 1e-2 / (i + 1)  # a schedule: each step's learning rate reaches the units
            model(x, labels=x).backward()
            if overlap:  # the clipping folded into the host step: clip_grad_norm_'s coefficient
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
                stepper.step(grad_scale=float(torch.clamp(0.5 / (norm.full_tensor() + 1e-6), max=1.0)))
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
        if overlap:
            stepper.wait()
        return model, opt

    ref_model, ref_opt = train(False)
    # resident units (the root and the embedding; all four units) are stepped at once, the rest behind the forward
    for delay, resident in ((0.0, 0), (0.02, 0), (0.02, 2), (0.0, 4)):
        model, opt = train(True, delay, resident)
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q.full_tensor()), (delay, resident, name)
            assert p.grad is None, name
        states = [opt.state[p] for p in model.parameters()]
        for a, b in zip(states, [ref_opt.state[q] for q in ref_model.parameters()], strict=True):
            assert all(
                torch.equal(
                    a[k].full_tensor() if hasattr(a[k], "full_tensor") else a[k],
                    b[k].full_tensor() if hasattr(b[k], "full_tensor") else b[k],
                )
                for k in b
            )
    assert opt.state_dict()["param_groups"][0].keys() == ref_opt.state_dict()["param_groups"][0].keys()

    # a state_dict of the model or of the optimizer, taken while the step runs, waits for it (a slowed step is
    # still running when each is asked for)
    model, opt = train(True)
    stepper = OverlappedHostStep(opt, model)
    _slow_unit_steps(stepper, lambda: time.sleep(0.05))
    x = batches[0]
    for take in (model.state_dict, opt.state_dict):
        model(x, labels=x).backward()
        stepper.step()
        assert not stepper._done[-1].is_set()
        take()
        assert stepper._thread is None and all(e.is_set() for e in stepper._done)

    # a failing step is raised on the main thread, at the next forward's wait
    model, opt = train(True)
    stepper = OverlappedHostStep(opt, model)
    calls = iter(range(100))

    def fail_second() -> None:
        if next(calls) == 1:
            raise OSError("disk on fire")

    _slow_unit_steps(stepper, fail_second)
    x = batches[0]
    model(x, labels=x).backward()
    stepper.step()
    with pytest.raises(RuntimeError, match="overlapped host optimizer step failed: disk on fire"):
        model(x, labels=x)


def test_resident_units_keep_their_states_out_of_the_offload():
    """``resident_units``: the first units in the forward's gathering order (the root, then the embedding and the
    layers) are sharded without FSDP2's CPU offload policy, the rest with it; a step with resident units equals the
    plain model's (float64); bad counts are refused naming the argument."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from longctx.distributed.offload import resident_parameters, unit_parameters

    cfg = GPTConfig(**TINY, share_embeddings_and_output_weights=False, **FULL)
    torch.manual_seed(0)
    plain = GPT(cfg).double()
    torch.manual_seed(0)
    model = GPT(cfg).double()
    offload_model(model, resident_units=2)
    policy = [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in [model, *decoder_units(model)]]
    assert [isinstance(p, CPUOffloadPolicy) for p in policy] == [False, False, True, True]
    owners = unit_parameters(model)
    assert resident_parameters(model) == {id(p) for ps in owners[:2] for p in ps}
    opt = host_adamw(model, lr=1e-2, weight_decay=0.0, max_grad_norm=0.5, overlap=True)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_length"]), generator=gen)
        model(x, labels=x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        plain(x, labels=x).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        ref.step()
        ref.zero_grad(set_to_none=True)
    opt.wait()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-10, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="resident_units=5 is more than the model's 4 units"):
        offload_model(GPT(cfg), resident_units=5)
    with pytest.raises(ValueError, match="resident_units must be an int >= 0, got -1"):
        offload_model(GPT(cfg), resident_units=-1)


def test_resident_units_in_the_memory_model_are_the_sharded_units_bytes():
    """The memory model's resident units are `apply_fsdp`'s: their shards' bytes (16 a parameter on the GPU) and the
    host's states of the others, counted on a model sharded with ``resident_units``; a first step's peak is the
    optimizer step's where the resident states are created."""
    from longctx.distributed.offload import resident_parameters

    cfg = GPTConfig(**TINY, share_embeddings_and_output_weights=False, **FULL)
    model = GPT(cfg)
    offload_model(model, resident_units=3)  # the output layer and final norm, the embedding, the first layer
    resident = resident_parameters(model)
    n_res = sum(p.numel() for p in model.parameters() if id(p) in resident)
    shapes = [p.shape for p in model.parameters() if id(p) not in resident]
    mem = memory_model.step_memory(cfg, seq_length=64, offload_params=True, resident_units=3)
    assert mem.resident_bytes == 16 * n_res and mem.optimizer_states == 8 * n_res and mem.gradients == 4 * n_res
    assert mem.host_states == memory_model.host_state_bytes(shapes, 1)
    plain = memory_model.step_memory(cfg, seq_length=64, offload_params=True)
    assert mem.parameters == plain.parameters + 4 * n_res and mem.total > plain.total
    assert mem.first_step_peak == max(mem.total - mem.optimizer_states, mem.resident_bytes + mem.overhead)
    assert memory_model.resident_split(cfg, 3) == (True, True, 1)
    assert memory_model.resident_split(cfg.replace(share_embeddings_and_output_weights=True), 3) == (True, True, 2)
    with pytest.raises(ValueError, match="resident_units must be an int from 0 to 4"):
        memory_model.step_memory(cfg, seq_length=64, offload_params=True, resident_units=5)
    with pytest.raises(ValueError, match="resident_units=1 keeps units of an offloaded model on the GPU"):
        memory_model.step_memory(cfg, seq_length=64, resident_units=1)


def _slow_unit_steps(stepper, before) -> None:
    """Run ``before()`` ahead of every unit's step of ``stepper`` (an `OverlappedHostStep`): a slow or failing
    background thread."""
    build = stepper._unit_step

    def unit_step(groups):
        unit = build(groups)
        if unit is not None:
            plain = unit[0].step
            unit[0].step = lambda: (before(), plain())
        return unit

    stepper._unit_step = unit_step


def test_host_grad_norm_is_the_total_norm_and_steps_locally(monkeypatch):
    """`host_grad_norm` over offloaded shards equals torch's total norm (pieces of a few elements, summed on
    several threads), and after a unit's first step the overlapped step runs on the shards' local tensors (no
    DTensor dispatch in the background thread)."""
    from longctx.distributed import offload

    cfg = GPTConfig(**TINY, share_embeddings_and_output_weights=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    offload_model(model)
    x = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_length"]))
    model(x, labels=x).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()
    monkeypatch.setattr(offload, "host_thread_share", lambda: 3)
    got = offload.host_grad_norm(model.parameters(), chunk=7)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    opt = host_adamw(model, lr=1e-2)
    stepper = offload.OverlappedHostStep(opt, model, background=False)
    seen = []
    build = stepper._unit_step
    stepper._unit_step = lambda groups: seen.append(build(groups)) or seen[-1]
    stepper.step()  # the first: through the DTensors, creating the states
    assert all(hasattr(p, "to_local") for u in seen for g in u[0].param_groups for p in g["params"])
    model(x, labels=x).backward()
    seen.clear()
    stepper.step()
    assert not any(hasattr(p, "to_local") for u in seen for g in u[0].param_groups for p in g["params"])
    assert all(p.grad is None for p in model.parameters())


def test_host_adamw_for_a_loop_of_ones_own_clips_and_overlaps():
    """`host_adamw(..., max_grad_norm=, overlap=True)` in a transformers-Trainer-like loop (a scheduler, zero_grad,
    a state_dict mid-run): overlapped equals in place to the bit, and both equal plain AdamW after torch's
    clipping; a non-finite gradient norm skips the step and leaves the weights; bad settings are named."""
    from longctx.distributed.offload import HostAdamW

    cfg = GPTConfig(**TINY, share_embeddings_and_output_weights=False)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, TINY["vocab_size"], (2, TINY["seq_length"]), generator=gen) for _ in range(3)]

    def train(kind: str):
        torch.manual_seed(0)
        model = GPT(cfg)
        offload_model(model)
        if kind == "plain":
            opt = host_adamw(model, lr=1e-2)
        else:
            opt = host_adamw(model, lr=1e-2, max_grad_norm=0.05, overlap=kind == "overlap")
            assert isinstance(opt, HostAdamW)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
        for x in batches:
            model(x, labels=x).backward()
            if kind == "plain":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            opt.state_dict()  # a checkpoint mid-run waits for the step
        if kind != "plain":
            opt.wait()
            assert opt.last_grad_norm > 0.05  # the clipping was taken
        return [p.full_tensor() for p in model.parameters()]

    inline, overlapped, plain = train("inline"), train("overlap"), train("plain")
    for a, b, c in zip(overlapped, inline, plain, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)

    torch.manual_seed(0)
    model = GPT(cfg)
    offload_model(model)
    opt = host_adamw(model, lr=1e-2, max_grad_norm=1.0, overlap=True)
    x = batches[0]
    model(x, labels=x).backward()
    next(model.parameters()).grad.to_local()[0] = float("inf")  # a gradient made infinite
    before = [p.full_tensor().clone() for p in model.parameters()]
    opt.step()
    opt.wait()
    assert opt.skipped_steps == 1 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), before, strict=True))
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number or None"):
        host_adamw(model, lr=1e-2, max_grad_norm=0)
    with pytest.raises(ValueError, match="takes no closure"):
        opt.step(lambda: 0.0)


def test_a_process_ending_with_the_host_step_in_flight_exits_cleanly():
    """A loop whose last ``step()`` is still running on the host when the script ends: the process waits for it and
    exits with 0 (the step's thread torn down inside torch at shutdown aborted it)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import torch
        from longctx.distributed.offload import host_adamw, offload_model
        from longctx.models.gpt import GPT, GPTConfig
        model = GPT(GPTConfig(**{TINY!r}))
        offload_model(model)
        opt = host_adamw(model, lr=1e-3, overlap=True)
        for _ in range(2):
            x = torch.randint(0, {TINY["vocab_size"]}, (2, {TINY["seq_length"]}))
            model(x, labels=x).backward()
            opt.step()
        assert opt.host_step._thread is not None  # in flight, or just ended
        print("done", flush=True)
        """
    )
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
