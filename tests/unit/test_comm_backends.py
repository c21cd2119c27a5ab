"""Which device a group's small collectives use, by its backend string: a process group of NCCL for CUDA tensors
with gloo beside it for CPU ones (what `init_distributed` creates on GPUs) keeps its collectives on the GPU, as
NCCL alone does; gloo alone runs them on the CPU."""

from __future__ import annotations

import pytest
import torch

from longctx.distributed.comm import GroupInfo, comm_device, cpu_group, cuda_backend


@pytest.mark.parametrize(
    ("backend", "cuda"),
    [("nccl", "nccl"), ("gloo", "gloo"), ("cpu:gloo,cuda:nccl", "nccl"), ("cuda:nccl,cpu:gloo", "nccl"),
     ("cpu:gloo", ""), ("none", "none")],
)  # fmt: skip
def test_cuda_backend(backend, cuda):
    assert cuda_backend(backend) == cuda


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo", "none"])
def test_gloo_alone_collects_on_the_cpu(backend):
    assert comm_device(GroupInfo("g", 0, 2, backend)) == torch.device("cpu")
    assert not GroupInfo("g", 0, 2, backend).is_nccl


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_collects_on_the_gpu_with_or_without_gloo_beside(backend):
    info = GroupInfo("g", 0, 2, backend)
    assert info.is_nccl
    hint = torch.empty(1, device="meta")  # not CUDA: the current device is asked for, so give one
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: 3)
        assert comm_device(info, hint) == torch.device("cuda", 3)


def test_a_group_with_gloo_beside_nccl_serves_cpu_collectives_itself():
    assert cpu_group(GroupInfo("g", 0, 2, "cpu:gloo,cuda:nccl")) == "g"
