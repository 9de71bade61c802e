"""A notebook replay's wait queue: which waiting request is offered freed capacity first.

Requests wait as ``(queued at, session id)`` in one first-come queue per
shape (class, slice, GPU count). Freed capacity is offered to the queues'
heads in the service's queue order
(:func:`gpupool.hub_plugin.rules.queue.sort_key`): interactive first when the
policy has classes, then, with no owner's last use replayed, oldest first;
a request that does not fit does not hold back a smaller one behind it. A
``fifo`` policy has one strict first-come queue instead.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

from gpupool.leaseclasses import default as default_class

from ..rules.queue import sort_key
from .pool import FULL


class WaitQueue:
    """``fifo``: one strict first-come queue; ``classes``: interactive and
    batch wait apart (False: every request counts as interactive)."""

    def __init__(self, fifo: bool, classes: bool) -> None:
        self.fifo, self.classes = fifo, classes
        self._line: deque = deque()  # the fifo policy's one queue
        self._queues: dict[tuple[str, int, int], deque] = {}  # (class, milli, GPUs) -> queue

    def of(self, klass: str, milli: int, gpus: int) -> deque:
        """The queue a request of this class and shape waits in."""
        if self.fifo:
            return self._line
        return self._queues.setdefault((klass if self.classes else default_class().name, milli, gpus), deque())

    def entries(self) -> Iterator[tuple[float, int]]:
        """Every waiting ``(queued at, session id)``."""
        for queue in [self._line] if self.fifo else self._queues.values():
            yield from queue

    def drain(self, acquire: Callable[[int], bool], klass: str | None = None) -> None:
        """Offer freed capacity: ``acquire(session id)`` places one waiting
        request (False: it does not fit) in the module docstring's order;
        ``klass``: only that class's requests (with classes; None: all)."""
        if self.fifo:
            while self._line and acquire(self._line[0][1]):
                self._line.popleft()
            return
        heads = [(queue[0][0], key) for key, queue in self._queues.items()
                 if queue and (klass is None or key[0] == klass)]
        heads.sort(key=lambda head: sort_key(head[1][0], head[0], head[1]))
        failed_milli, failed_gpus = FULL + 1, 10**9  # smallest slice / whole-GPU count refused in this pass
        for _, key in heads:
            _, milli, gpus = key
            if (gpus == 1 and milli >= failed_milli) or (gpus > 1 and gpus >= failed_gpus):
                continue
            queue = self._queues[key]
            while queue and acquire(queue[0][1]):
                queue.popleft()
            if queue:
                if gpus == 1:
                    failed_milli = milli
                    if milli == FULL:
                        failed_gpus = 2  # no idle GPU left
                else:
                    failed_gpus = gpus
