"""The launchers as `torch.library` ops with autograd and fake implementations, so `torch.compile` traces a
model through them and a selective-recompute policy can name them: `flash` (dense), `sparse` (block masks).

In plain eager calls the same launchers run through a `torch.autograd.Function` twin instead (`through_op` says
which): the op's Python autograd wrapper (its arguments flattened and unflattened, its defaults filled, a
redispatch) is host time on every call, which a short call feels (docs/performance.md, "Host time per call").

The ops are defined with the low-level `torch.library.Library` API rather than ``torch.library.custom_op``: a
``custom_op`` wraps its kernel so that its first call imports ``torch._dynamo``, seconds of Python imports in front of
the first attention call of every process, whether or not the model is compiled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

LIB = torch.library.Library("longctx", "DEF")


def define(name: str, schema: str, impl: Callable, fake: Callable) -> None:
    """Define ``longctx::<name>`` with ``schema``, its kernel for every device and its fake (meta) implementation."""
    LIB.define(name + schema)
    LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"longctx::{name}", fake, lib=LIB)


def through_op(q: torch.Tensor) -> bool:
    """Whether a call goes through the registered op rather than its eager twin: under torch.compile's tracing (the
    op is what the graph holds), under a Python dispatch mode (a selective-recompute policy or a FLOP counter sees
    the op; FakeTensorMode runs its fake), and for inputs other than plain tensors on a real device (meta, fake,
    subclasses: the op's fake implementation and the subclass's dispatch serve them)."""
    return (
        type(q) is not torch.Tensor
        or q.is_meta
        or torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
    )


def eager_twin(forward: Callable, setup_context: Callable, gradients: Callable, n_inputs: int) -> type:
    """The `torch.autograd.Function` an op runs as in plain eager calls: ``forward(*inputs) -> (out, lse)`` with the
    op's ``setup_context``, and ``gradients(ctx, dout, dlse) -> (dq, dk, dv)`` for the first three of its
    ``n_inputs`` inputs (None for the rest). As the op: None, not zeros, for an output the loss does not use."""

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            ctx.set_materialize_grads(False)
            return output

        @staticmethod
        def backward(ctx, dout, dlse):
            return (*gradients(ctx, dout, dlse), *(None,) * (n_inputs - 3))

    return _Eager
