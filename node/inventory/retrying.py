"""An inventory that survives NVML failing: the agent keeps running.

When NVML cannot start (the driver is not loaded yet, or its kernel module
and library disagree after a driver upgrade: ``NVML_ERROR_LIB_RM_VERSION_MISMATCH``)
or stops answering later, :class:`RetryingInventory` says why in
:attr:`~.base.Inventory.error`, which the agent sends to the service
(``inventory_error``: the node is ``degraded``, its leases and workers go on,
nothing new is placed there), reads no GPU, and opens NVML again after a
delay that doubles from ``first`` to ``longest`` seconds (default 5 s to
5 min, :func:`backoff_delay`); a success resets it. It logs one line per
change of state, not one per attempt.

The agent runs it inside its NVML helper process (:mod:`.nvml.helper`);
:mod:`.nvml.watch` replaces the helper itself, on the same schedule, when a
call hangs.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from gpupool.wire.nodes import GPUInfo

from .base import Inventory, InventoryError

log = logging.getLogger("gpupool.agent")

#: The longest ``error`` sent to the service (it refuses longer ones).
MAX_ERROR = 500


def backoff_delay(failures: int, first: float = 5.0, longest: float = 300.0) -> float:
    """Seconds to wait after ``failures`` failed attempts in a row (1 or more):
    ``first`` doubled for each failure after the first, at most ``longest``.
    Raises ValueError for fewer than one failure or a non-positive ``first``."""
    if failures < 1 or first <= 0:
        raise ValueError(f"backoff_delay needs failures >= 1 and first > 0, got {failures} and {first}")
    return min(longest, first * 2 ** min(failures - 1, 64))


class RetryingInventory(Inventory):
    """The inventory ``open_inventory()`` returns (an :class:`~.nvml.inventory.NVMLInventory`),
    opened again whenever it fails.

    ``open_inventory`` raises :class:`InventoryError` when it cannot open one.
    At construction such an error is raised on unless it is ``retryable``
    (no driver library at all, no GPU: the agent exits and says to pass
    ``--simulate``); a retryable one leaves the inventory failed, as does
    any error later. ``clock``: monotonic seconds (tests pass their own).
    """

    kind = "nvml"

    def __init__(self, open_inventory: Callable[[], Inventory], *, first: float = 5.0, longest: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._open_inventory = open_inventory
        self.first, self.longest = first, longest
        self._clock = clock
        self._inner: Inventory | None = None
        self._gpus: list[GPUInfo] = []
        self.failures = 0
        self.next_attempt = 0.0
        try:
            self._open()
        except InventoryError as exc:
            if not exc.retryable:
                raise
            self._failed(exc)

    def _open(self) -> None:
        """Open the inventory and read its GPUs; raises InventoryError (having
        closed what it opened)."""
        inner = self._open_inventory()
        try:
            gpus = inner.discover()
        except InventoryError:
            inner.close()
            raise
        self._inner, self._gpus = inner, gpus

    def _failed(self, exc: InventoryError) -> None:
        """Record a failed attempt (or a failure found by a check) and when to try again."""
        self.failures += 1
        delay = backoff_delay(self.failures, self.first, self.longest)
        self.next_attempt = self._clock() + delay
        reason = exc.reason[:MAX_ERROR]
        if self.error is None:
            log.warning("%s: this node reports it cannot read its GPUs (its leases go on, no new ones come); "
                        "trying again in %gs, then less and less often (up to every %gs)", exc.message, delay,
                        self.longest)
        else:
            level = logging.INFO if reason != self.error else logging.DEBUG
            log.log(level, "NVML still fails (%s); next attempt in %gs", reason, delay)
        self.error = reason

    def refresh(self) -> bool:
        """Check a working inventory (:meth:`~.nvml.inventory.NVMLInventory.check`), or
        open a failed one again when its delay has passed. True when it just
        came back (its GPUs are to be registered again)."""
        if self._inner is not None:
            try:
                self._inner.check()
            except InventoryError as exc:
                self._inner.close()
                self._inner = None
                self._failed(exc)
            return False
        if self._clock() < self.next_attempt:
            return False
        try:
            self._open()
        except InventoryError as exc:
            self._failed(exc)
            return False
        log.warning("NVML works again after %d failed attempt(s): this node reports its GPUs again", self.failures)
        self.error, self.failures, self.next_attempt = None, 0, 0.0
        return True

    # -- the Inventory contract, answered by the working inventory; nothing while failed ----------------------

    def discover(self) -> list[GPUInfo]:
        """The GPUs read when the inventory last opened: while it fails, the
        ones last known (none when it never worked). Never raises."""
        return list(self._gpus)

    def metrics(self) -> list[dict[str, Any]]:
        return [] if self._inner is None else self._inner.metrics()

    def process_memory(self) -> dict[int, int]:
        return {} if self._inner is None else self._inner.process_memory()

    def process_usage(self) -> list:
        return [] if self._inner is None else self._inner.process_usage()

    def process_known(self) -> set[str]:
        return set() if self._inner is None else self._inner.process_known()

    def versions(self) -> dict[str, str | None]:
        return {"driver": None, "cuda": None} if self._inner is None else self._inner.versions()

    def health(self) -> dict[str, dict[str, Any]]:
        return {} if self._inner is None else self._inner.health()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None
