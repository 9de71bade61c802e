"""The agent's memory watchdog, for modes where nothing else caps a worker's GPU memory."""

from __future__ import annotations

MiB = 1024**2


class MemoryWatchdog:
    """The agent's memory watchdog: stops a worker whose process tree uses
    more GPU memory than its slice, as NVML measures it.

    NVML counts a process's CUDA context (a few hundred MiB) that framework
    caps do not, so a worker is over when it uses more than ``limit +
    allowance`` bytes on one GPU (``allowance`` in bytes), for ``strikes``
    readings in a row (a one-off peak while a framework frees memory is
    forgiven). Pure: readings in, verdicts out.
    """

    def __init__(self, allowance: int = 1024 * MiB, strikes: int = 2) -> None:
        self.allowance, self.strikes = allowance, strikes
        self._over: dict[str, int] = {}

    def check(self, usage: dict[str, dict[str, int]], limits: dict[str, int]) -> list[tuple[str, str]]:
        """``usage``: lease -> GPU UUID -> bytes; ``limits``: lease -> bytes per
        GPU. Returns ``(lease, reason)`` for each worker to stop now."""
        verdicts = []
        for lease in list(self._over):
            if lease not in limits:
                del self._over[lease]
        for lease, limit in limits.items():
            worst = max(usage.get(lease, {}).items(), key=lambda item: item[1], default=None)
            if worst is None or worst[1] <= limit + self.allowance:
                self._over.pop(lease, None)
                continue
            self._over[lease] = self._over.get(lease, 0) + 1
            if self._over[lease] >= self.strikes:
                del self._over[lease]
                verdicts.append((lease, f"it used {worst[1] // MiB} MiB on GPU {worst[0]}, more than its slice's "
                                        f"{limit // MiB} MiB (+{self.allowance // MiB} MiB for the CUDA context)"))
        return verdicts
