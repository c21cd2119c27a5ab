"""The lowest layer: GPU kernels only (``@triton.jit`` in `kernels.triton`, Gluon in `kernels.gluon`), no torch-side
logic, so every Triton kernel runs under ``TRITON_INTERPRET=1`` on the CPU. Launchers: `longctx.launchers`."""
