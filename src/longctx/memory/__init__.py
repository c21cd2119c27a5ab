"""Memory, counted: `measure` (bytes autograd saves for backward; the peak of live tensor bytes)."""

from __future__ import annotations

from longctx.memory.measure import LiveBytesTracker, peak_live_bytes, saved_bytes

__all__ = ["LiveBytesTracker", "peak_live_bytes", "saved_bytes"]
