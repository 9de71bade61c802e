"""ipykernel's OutStream, without the flush round trip when nothing is pending.

ipykernel flushes ``sys.stdout`` and ``sys.stderr`` after every shell
message; each flush waits for a round trip to the IOPub thread (about 0.3 ms
on a 2-core VM, ipykernel 7.4) even when nothing was written, which is the
common case for a forwarded cell: its output is the worker's, relayed. The
gpupool kernel runs with this class (``--IPKernelApp.outstream_class``).
What "pending" means is ipykernel's private state
(:func:`gpupool.ipykernel_private.nothing_pending`).
"""

from __future__ import annotations

from ipykernel.iostream import OutStream

from gpupool.ipykernel_private import nothing_pending


class QuietOutStream(OutStream):
    """OutStream whose ``flush`` returns at once when no write is pending."""

    def flush(self) -> None:
        if nothing_pending(self):
            return
        super().flush()
