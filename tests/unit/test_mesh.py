"""`longctx.distributed.mesh` without other processes: argument validation, the dp-major rank layout, a global
batch split by dp rank, and the errors of a mesh that one process cannot hold (`init_mesh`, `longctx train`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx.distributed.mesh import MESH_DIMS, ParallelDims, batch_rows, init_mesh, share_of_mean
from longctx.training.config import TrainConfig, parse_config


@pytest.fixture
def no_process_group():
    """Closes the process group a test's `init_mesh` opened in this process."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("dp, cp, world", [(1, 1, 1), (2, 1, 2), (1, 4, 4), (2, 4, 8), (16, 8, 128)])
def test_world_size_is_the_product(dp, cp, world):
    dims = ParallelDims(dp, cp)
    assert dims.world_size == world
    assert dims.world_error(world) is None
    dims.check_world(world)


@pytest.mark.parametrize("name", ["data_parallel", "context_parallel"])
@pytest.mark.parametrize("value", [0, -2])
def test_sizes_below_one_are_value_errors_naming_the_argument(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be >= 1, got {value}"):
        ParallelDims(**{name: value})


@pytest.mark.parametrize("name", ["data_parallel", "context_parallel"])
@pytest.mark.parametrize("value", [2.0, "2", True, None])
def test_sizes_that_are_not_ints_are_type_errors(name, value):
    with pytest.raises(TypeError, match=rf"{name} must be an int >= 1, got {value!r}"):
        ParallelDims(**{name: value})


def test_a_world_of_another_size_names_both_sizes_and_the_fix():
    dims = ParallelDims(data_parallel=2, context_parallel=4)
    with pytest.raises(ValueError, match=r"needs 8 processes, got world size 6; .*torchrun .*N \* M = 8"):
        dims.check_world(6)


def test_ranks_are_dp_major():
    dims = ParallelDims(data_parallel=3, context_parallel=2)
    assert [dims.rank_coords(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 6\), got 6"):
        dims.rank_coords(6)


class _FakeMesh:
    mesh_dim_names = MESH_DIMS

    def __init__(self, dp: int, rank: int) -> None:
        self.dp, self.rank = dp, rank

    def size(self, dim: int = 0) -> int:
        return self.dp

    def get_local_rank(self, name: str) -> int:
        return self.rank


def test_batch_rows_splits_the_global_batch_by_dp_rank():
    x = torch.arange(24).reshape(6, 4)
    parts = [batch_rows(x, _FakeMesh(3, r)) for r in range(3)]
    assert torch.equal(torch.cat(parts), x) and all(p.shape == (2, 4) for p in parts)
    assert batch_rows(None, _FakeMesh(3, 0)) is None
    with pytest.raises(ValueError, match=r"global batch has 6 sequences, not divisible by data_parallel=4"):
        batch_rows(x, _FakeMesh(4, 0))
    with pytest.raises(TypeError, match=r"mesh must be the DeviceMesh of init_mesh"):
        batch_rows(x, object())


def test_share_of_mean_is_token_weighted_in_one_process():
    local_sum = torch.tensor(6.0, requires_grad=True)
    loss, value = share_of_mean(local_sum, 4)
    assert float(value) == 1.5 and value.dtype == torch.float32
    loss.backward()
    assert float(local_sum.grad) == 0.25


def test_init_mesh_in_one_process(no_process_group):
    mesh = init_mesh(1, 1)
    assert mesh.mesh_dim_names == MESH_DIMS and mesh.shape == (1, 1)


def test_init_mesh_refuses_a_mesh_one_process_cannot_hold(no_process_group):
    with pytest.raises(
        ValueError, match=r"--data-parallel 2 x --context-parallel 1 needs 2 processes, got world size 1"
    ):
        init_mesh(2, 1)


def test_train_config_checks_data_parallel():
    assert TrainConfig(data_parallel=4).data_parallel == 4
    assert parse_config(["--data-parallel", "2", "--context-parallel", "2"]).data_parallel == 2
    with pytest.raises(ValueError, match=r"data_parallel must be >= 1, got 0"):
        TrainConfig(data_parallel=0)
    with pytest.raises(TypeError, match=r"--data-parallel must be an int"):
        parse_config(["--data-parallel", "two"])


def test_train_without_torchrun_says_how_many_processes(no_process_group, tmp_path):
    from longctx.training.trainer import Trainer

    cfg = TrainConfig(preset="tiny", data_parallel=2, save=str(tmp_path / "run"), quiet=True)
    with pytest.raises(ValueError, match=r"needs 2 processes, got world size 1"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()  # nothing was written


def test_context_parallel_without_init_process_group_says_so():
    """Built without torch.distributed, ContextParallel raises at construction, not at the first forward."""
    import torch.distributed as dist

    from longctx.distributed import SINGLE_PROCESS, ContextParallel

    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed initialised")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ContextParallel()
    cp = ContextParallel(group=SINGLE_PROCESS)
    assert (cp.rank, cp.world) == (0, 1)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(cp_method="p2p", context_parallel=2), "needs --doc-separator"),
        (dict(cp_method="ulysses_ring", context_parallel=4), "goes with cp_method 'ulysses_ring'"),
        (dict(cp_ulysses_size=2, context_parallel=4), "goes with cp_method 'ulysses_ring'"),
        (dict(cp_method="ulysses_ring", cp_ulysses_size=3, context_parallel=4), "must divide context_parallel"),
        (dict(cp_method="ulysses_ring", cp_ulysses_size=4, context_parallel=4), "smaller than it"),
    ],
)
def test_train_config_cp_methods(kw, match):
    from longctx.training.config import TrainConfig

    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)
    ok = TrainConfig(cp_method="ulysses_ring", cp_ulysses_size=2, context_parallel=4)
    assert ok.cp_ulysses_size == 2


def test_train_config_auto_cp_method(tmp_path):
    """cp_method "auto": ulysses over packed documents where the heads split over the ranks, p2p where they do not,
    ring for one dense sequence; a named method is kept."""
    from longctx.training.config import TrainConfig

    text = tmp_path / "t.txt"
    text.write_bytes(b"ab\x00cd\x00")
    docs = dict(data=str(text), doc_separator="\\x00", preset="tiny")
    heads = TrainConfig(preset="tiny").model_config().num_attention_heads
    assert TrainConfig(context_parallel=2, preset="tiny").context_parallel_method() == "ring"
    assert TrainConfig(context_parallel=2, **docs).context_parallel_method() == "ulysses"
    assert TrainConfig(context_parallel=2 * heads, **docs).context_parallel_method() == "p2p"
    assert TrainConfig(context_parallel=2, cp_method="allgather", **docs).context_parallel_method() == "allgather"


def test_splits_heads():
    from longctx.distributed.ulysses import splits_heads

    assert splits_heads(16, 4, 4) and splits_heads(16, 4, 8)  # kv heads repeated for 8 ranks
    assert not splits_heads(16, 4, 3) and not splits_heads(6, 4, 3) and not splits_heads(12, 8, 6)


def test_model_error_refuses_kept_attention_under_context_parallelism():
    """Kept attention outputs do not apply to a context-parallel core attention: the run is refused (on every rank:
    `setup.model_error` is checked collectively) unless a memory budget's plan chooses the recomputation."""
    from longctx.training.config import TrainConfig
    from longctx.training.setup import model_error

    kept = {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
        "recompute_skip_core_attention": True,
    }
    assert "does not apply under context parallelism" in model_error(
        TrainConfig(context_parallel=2, preset="tiny", model=kept)
    )
    assert model_error(TrainConfig(context_parallel=2, preset="tiny", model=kept, memory_budget="1GiB")) is None
    assert model_error(TrainConfig(context_parallel=1, preset="tiny", model=kept)) is None
