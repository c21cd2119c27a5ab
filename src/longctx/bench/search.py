"""The search for the longest sequence under a memory cap: doubling, then bisection guided by a line fit."""

from __future__ import annotations

import time

QUANTUM = 256  # tokens per GPU: S = P x tokens/GPU is then a multiple of 2P x 128 (zigzag chunks of 128 tokens)


def _linfit(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line ``y = a + b x`` through (x, y) points (at least two distinct x)."""
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return my - b * mx, b


def search_longest(
    try_fn,
    *,
    start: int,
    cap: float,
    res: float = 0.08,
    limit: int = 1 << 21,
    budget_s: float = float("inf"),
    quantum: int = QUANTUM,
    prior: tuple[float, float] | None = None,
    known: list[dict] | None = None,
    clock=time.perf_counter,
) -> dict:
    """The longest n (a multiple of ``quantum``, at most ``limit``) for which ``try_fn(n)`` fits under ``cap``.

    ``try_fn(n)`` runs one try and returns a dict with ``status`` ("ok", "over" or "error"), ``peak`` (the
    figure compared with ``cap``) and ``secs``. The search doubles from ``start`` until a try does not fit
    (halves while the first ones do not), then bisects until the bracket [longest fit, shortest misfit] is
    within ``res`` of the longest fit. Peaks are close to linear in n (flash attention, full recomputation):
    once two fits are known, or from ``prior`` = (peak at n = 0, peak per token) of an earlier search, the next
    try aims just below the predicted crossing of the cap instead of doubling blindly (up to 4x instead of 2x);
    the tries still decide. ``known``: tries already made (with "n"; e.g. a warm-up step) that count as points
    of the line and as fits, but are neither repeated nor used to estimate the time of the next try.
    Stops early, with what it has, when the next try would not end within ``budget_s`` (its time estimated
    from the longest fit, quadratic in n) or a try fails with an error.

    Returns dict(best=longest fit or None, over=shortest misfit or None, tries=[try dicts with "n"],
    stop=why it stopped, secs).
    """
    t0 = clock()
    tries: list[dict] = [dict(t, known=True) for t in known or []]
    lo = max((t["n"] for t in tries if t["status"] == "ok"), default=None)
    hi = min((t["n"] for t in tries if t["status"] == "over"), default=None)
    n = max(quantum, start // quantum * quantum)
    limit = max(quantum, limit // quantum * quantum)
    if hi is not None and n >= hi:  # a known try already misfits below the start
        if hi <= quantum:
            return dict(best=lo, over=hi, tries=tries, stop="nothing fits", secs=clock() - t0)
        n = max(quantum, hi // 2 // quantum * quantum)
    if lo is not None and n <= lo:  # nor repeat what is known to fit
        n = min(2 * lo, limit)
    while True:
        r = dict(try_fn(n))
        r["n"] = n
        tries.append(r)
        if r["status"] == "error":
            stop = "error"
            break
        if r["status"] == "ok":
            lo = n if lo is None else max(lo, n)
        else:
            hi = n if hi is None else min(hi, n)
        if lo is not None and hi is not None and hi - lo <= max(quantum, res * lo):
            stop = "resolution"
            break
        if lo is None and hi is not None and hi <= quantum:
            stop = "nothing fits"
            break
        if hi is None and lo is not None and lo >= limit:
            stop = "limit"
            break
        pred = _predict(tries, cap, prior)
        if hi is None:  # growing: double, or aim just below the predicted crossing
            nxt = 2.0 * lo
            if pred is not None and pred > lo:
                nxt = min(4.0 * lo, max(lo * (1 + res), pred * (1 - res / 3)))
            nxt = min(nxt, limit)
        elif lo is None:  # shrinking: halve, or aim below the prediction
            nxt = hi / 2
            if pred is not None:
                nxt = max(nxt, min(hi * (1 - res), pred * (1 - res / 3)))
        else:  # bisect, towards the prediction when it lies inside the bracket
            w = hi - lo
            nxt = (lo + hi) / 2
            if pred is not None and lo < pred < hi:
                nxt = min(max(pred, lo + w / 4), hi - w / 4)
        nxt = int(nxt) // quantum * quantum
        if lo is not None:  # at least one quantum away from both ends
            nxt = max(nxt, lo + quantum)
        if hi is not None:
            nxt = min(nxt, hi - quantum)
        if hi is None and nxt > limit:
            stop = "limit"
            break
        mine = [t for t in tries if not t.get("known")]
        ref = max((t for t in mine if t["status"] == "ok"), key=lambda t: t["n"], default=mine[-1])
        est = ref["secs"] * (nxt / ref["n"]) ** 2
        if clock() - t0 + est > budget_s:
            stop = f"time budget ({budget_s:.0f} s; the next try, {nxt} tokens, was estimated at {est:.0f} s)"
            break
        n = nxt
    return dict(best=lo, over=hi, tries=tries, stop=stop, secs=clock() - t0)


def _predict(tries: list[dict], cap: float, prior: tuple[float, float] | None) -> float | None:
    """n where the line through the fitting tries' peaks (or the prior's slope) reaches the cap."""
    pts = [(t["n"], t["peak"]) for t in tries if t["status"] == "ok"]
    ab = None
    if len(pts) >= 2:
        ab = _linfit(pts)
    elif prior is not None:
        ab = prior
        if pts:  # the prior's slope through our own point
            ab = (pts[0][1] - prior[1] * pts[0][0], prior[1])
    if ab is None or ab[1] <= 0:
        return None
    return (cap - ab[0]) / ab[1]
