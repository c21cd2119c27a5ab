"""GPU lane: each test gives its cached CUDA memory back when it ends, so that many xdist workers sharing one GPU
(``pytest -n 8 tests/gpu``) do not each keep gigabytes reserved by the caching allocator and run the others out of
memory."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_cuda_cache():
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
