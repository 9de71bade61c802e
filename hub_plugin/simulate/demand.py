"""Interactive demand over a notebook replay's clock, for the batch headroom
(:func:`gpupool.hub_plugin.rules.priority.headroom`): GPUs interactive leases
hold plus GPUs interactive requests wait for, and its peak per minute over a
recent window."""

from __future__ import annotations

from collections import deque

#: Width of one peak bucket, seconds.
BUCKET_S = 60.0


class InteractiveDemand:
    """``window``: seconds of history the recent peak covers (0: none kept, the peak is the present)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.held = 0.0  # GPUs interactive leases hold
        self.asked = 0.0  # GPUs waiting interactive requests ask for
        self.waiting = 0  # waiting interactive requests
        self._peaks: deque = deque()  # (bucket start, peak of held + asked in it)

    def change(self, now: float, held: float = 0.0, asked: float = 0.0, waiting: int = 0) -> None:
        """Add ``held`` / ``asked`` GPUs and ``waiting`` requests (negative: removed) at ``now``."""
        self.held += held
        self.asked += asked
        self.waiting += waiting
        if self.window <= 0:
            return
        bucket = now // BUCKET_S * BUCKET_S
        total = self.held + self.asked
        if self._peaks and self._peaks[-1][0] == bucket:
            if total > self._peaks[-1][1]:
                self._peaks[-1] = (bucket, total)
        else:
            self._peaks.append((bucket, total))
        while self._peaks and self._peaks[0][0] < bucket - self.window:
            self._peaks.popleft()

    def recent(self) -> list[float]:
        """The per-minute peaks of the window, and the present."""
        return [peak for _, peak in self._peaks] + [self.held + self.asked]
