"""The host's part of an offloaded step, and why `OverlappedHostStep` does or does not shorten it on this machine:
one offloaded model (llama-3b at 32K by default, the plan of ``--budget``/``--host-budget``), built once, each way
of taking the host's work after the backward timed on it.

Modes (the median of ``--steps`` steps after a warm-up; the GPU synchronised at each step's end): torch's
``clip_grad_norm_`` then ``optimizer.step()`` (what the trainer took before), `host_grad_norm` then the step in
place, and `host_grad_norm` then `OverlappedHostStep` at each of ``--threads`` (with how long the forward's hooks
waited for units not yet stepped). ``--parts modes+contention`` then measures what a background AdamW step over the
DTensors takes from the main thread: a kernel launch's time and a pinned host-to-GPU copy's bandwidth, alone and
beside it. ``--parts diagnose`` instead times the clipping's parts (torch's norm, over the DTensors and their local
tensors; the multiply), AdamW over the DTensors and over their local tensors, and a launch beside a background step
of each, with the default and a short GIL switch interval. Prints JSON lines; ``--out`` writes them too.

    PYTHONPATH=src python dev/host_step_overlap.py [--preset llama-3b --seq-length 32768 --threads 16,8,4]
    PYTHONPATH=src python dev/host_step_overlap.py --parts diagnose
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3b")
    ap.add_argument("--seq-length", type=int, default=32768)
    ap.add_argument("--budget", default="135GiB")
    ap.add_argument("--host-budget", default="110GiB")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", default="16", help="host thread counts of the overlapped step")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--parts",
        default="modes",
        choices=["modes", "modes+contention", "diagnose"],
        help="diagnose: where the host's time goes (gradient clipping, the GIL) instead of the modes",
    )
    args = ap.parse_args()

    from longctx.distributed import offload
    from longctx.memory.plan import parameter_count, plan
    from longctx.models.gpt import GPT, GPTConfig

    lines: list[dict] = []

    def emit(d: dict) -> None:
        print(json.dumps(d), flush=True)
        lines.append(d)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(json.dumps(x) for x in lines) + "\n")

    device = torch.device("cuda")
    chosen = plan(GPTConfig.preset(args.preset), seq_length=args.seq_length, budget=args.budget,
                  host_budget=args.host_budget, offload_params=True)  # fmt: skip
    cfg = chosen.config
    torch.manual_seed(0)
    with offload.build_device(parameter_count(cfg)[1], device):
        model = GPT(cfg)
    offload.offload_model(model)
    opt = offload.host_adamw(model, lr=1e-5)
    overlap = offload.OverlappedHostStep(opt, model)
    waited = [0.0]
    plain_wait = overlap._wait_until

    def timed_wait(last: int) -> None:
        t = time.perf_counter()
        plain_wait(last)
        waited[0] += time.perf_counter() - t

    overlap._wait_until = timed_wait
    x = torch.randint(0, cfg.vocab_size, (1, args.seq_length), device=device)
    share = [offload.host_thread_share()]
    offload.host_thread_share = lambda: share[0]  # what host_threads and the step hooks read
    emit({"preset": args.preset, "seq_length": args.seq_length, "plan": chosen.settings,
          "cores": len(os.sched_getaffinity(0)), "gpu": torch.cuda.get_device_name()})  # fmt: skip

    if args.parts == "diagnose":
        diagnose(model, opt, x, offload, share, emit)
        return

    def step(overlapped: bool, norm: str) -> tuple[float, float]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=x)
        loss.backward()
        if norm == "torch":  # what the trainer took before: torch's clip over the DTensor shards
            with offload.host_threads():
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t_opt = time.perf_counter()
        scale = None
        if norm == "host":
            scale = offload.clip_scale(float(offload.host_grad_norm(model.parameters())), 1.0)
        if overlapped:
            overlap.step(grad_scale=scale)
        else:
            if scale is not None:
                torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], scale)
            opt.step()
            opt.zero_grad(set_to_none=True)
        t_end = time.perf_counter()
        torch.cuda.synchronize()
        return time.perf_counter() - t, t_end - t_opt

    modes = [
        ("in place, torch's clip", False, "torch", share[0]),
        ("in place, host_grad_norm", False, "host", share[0]),
    ]
    modes += [("overlapped, host_grad_norm", True, "host", int(n)) for n in args.threads.split(",")]
    for name, overlapped, norm, threads in modes:
        share[0] = threads
        overlap.wait()
        step(overlapped, norm)  # warm-up (and the first overlapped step's start)
        waited[0] = 0.0
        times = [step(overlapped, norm) for _ in range(args.steps)]
        overlap.wait()
        emit({"mode": name, "threads": threads, "step_s": statistics.median(t for t, _ in times),
              "after_backward_s": statistics.median(o for _, o in times),
              "hooks_waited_s": waited[0] / args.steps if overlapped else None})  # fmt: skip
    if args.parts == "modes":
        return

    # contention: an AdamW step running in a background thread (as the overlapped one does) against copies and
    # launches on the main thread
    pinned = torch.empty(2 * 2**30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(pinned, device=device)
    small = torch.zeros(1024, device=device)

    def copy_gbs() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(4):
            dst.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        return 4 * pinned.numel() / (time.perf_counter() - t) / 1e9

    def launches_us() -> float:
        return launch_us(small, 2000)

    for p in model.parameters():  # gradients for the background steps
        p.grad = torch.zeros_like(p)
    for threads in [int(n) for n in args.threads.split(",")]:
        share[0] = threads
        alone = (copy_gbs(), launches_us())
        beside = beside_steps(opt, offload, lambda: (copy_gbs(), launches_us()))
        emit({"contention_threads": threads, "copy_gbs_alone": alone[0], "copy_gbs_beside_adamw": beside[0],
              "launch_us_alone": alone[1], "launch_us_beside_adamw": beside[1]})  # fmt: skip


def beside_steps(opt, offload, measure):
    """``measure()`` while another thread runs ``opt.step()`` in a loop on the host's threads (as the overlapped
    step does), from the end of its first step."""
    stop, busy = threading.Event(), threading.Event()

    def background() -> None:
        while not stop.is_set():
            with offload.host_threads():
                opt.step()
            busy.set()

    th = threading.Thread(target=background, daemon=True)
    th.start()
    busy.wait()
    try:
        return measure()
    finally:
        stop.set()
        th.join()


def launch_us(t: torch.Tensor, n: int) -> float:
    """The main thread's time to launch one small kernel (``t.add_``), over ``n`` in a row."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        t.add_(1.0)
    dt = time.perf_counter() - start
    torch.cuda.synchronize()
    return dt / n * 1e6


def diagnose(model, opt, x, offload, share, emit) -> None:
    """The gradient clipping's parts on the host (torch's clip_grad_norm_ over the DTensor shards, the norm alone,
    and the same over the shards' local tensors), and a kernel launch's time on the main thread beside a background
    AdamW step over the DTensors, over their local tensors, and with a shorter GIL switch interval."""
    import sys

    def local(t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    def timed(fn, reps=2) -> float:
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return min(out)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, labels=x)
    loss.backward()
    torch.cuda.synchronize()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    lgrads = [local(g) for g in grads]
    with offload.host_threads():
        emit({"clip_grad_norm_s": timed(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9)),
              "get_total_norm_s": timed(lambda: torch.nn.utils.get_total_norm(grads)),
              "local_foreach_norm_s": timed(lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(lgrads)))),
              "local_foreach_mul_s": timed(lambda: torch._foreach_mul_(lgrads, 1.0)),
              "opt_step_dtensor_s": timed(opt.step),
              "threads": torch.get_num_threads()})  # fmt: skip
    # a plain AdamW over the local tensors (its own states: for timing only)
    lparams = [local(p) for p in params]
    for lp, g in zip(lparams, lgrads, strict=True):
        lp.grad = g
    lopt = torch.optim.AdamW(lparams, lr=1e-5, fused=True)
    with offload.host_threads():
        lopt.step()
        emit({"opt_step_local_s": timed(lopt.step)})
    small = torch.zeros(1024, device="cuda")

    def launches_us() -> float:
        return launch_us(small, 500)

    for name, o, interval in [("dtensor", opt, None), ("local", lopt, None), ("dtensor", opt, 1e-4),
                              ("local", lopt, 1e-4)]:  # fmt: skip
        before = sys.getswitchinterval()
        if interval:
            sys.setswitchinterval(interval)
        beside = beside_steps(o, offload, launches_us)
        sys.setswitchinterval(before)
        emit({"optimizer": name, "switch_interval": interval, "launch_us_alone": launches_us(),
              "launch_us_beside_adamw": beside})  # fmt: skip


if __name__ == "__main__":
    main()
