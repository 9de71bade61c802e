"""ipykernel's OutStream, without the flush round trip when nothing is pending.

ipykernel flushes ``sys.stdout`` and ``sys.stderr`` after every shell
message; each flush waits for a round trip to the IOPub thread (about 0.3 ms
here, NOTES-jupyter.md) even when nothing was written, which is the common
case for a forwarded cell: its output is the worker's, relayed. The gpupool
kernel runs with this class (``--IPKernelApp.outstream_class``).
"""

from __future__ import annotations

from ipykernel.iostream import OutStream


class QuietOutStream(OutStream):
    """OutStream whose ``flush`` returns at once when no write is pending."""

    def flush(self) -> None:
        if self._nothing_pending():
            return
        super().flush()

    def _nothing_pending(self) -> bool:
        # ipykernel 7's own state: a write sets _flush_pending and fills _buffers;
        # an unknown layout (another ipykernel) always flushes.
        try:
            if self._flush_pending or self._subprocess_flush_pending or self.echo is not None:
                return False
            with self._buffer_lock:
                return not any(buffer.tell() for buffer in self._buffers.values())
        except AttributeError:
            return False
