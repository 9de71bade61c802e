"""The pool service's client for the ``%gpu`` magics, made when first needed."""

from __future__ import annotations

from gpupool.api import ServiceClient


class Service:
    """Holds one :class:`~gpupool.api.ServiceClient`, built from
    ``GPUPOOL_URL``/``GPUPOOL_TOKEN`` at the first use of :attr:`client`:
    loading the magics needs neither, and a missing URL is the first ``%gpu``
    command's GPUPoolError ``not_configured`` (the magics' UsageError)."""

    def __init__(self) -> None:
        self._client: ServiceClient | None = None

    @property
    def client(self) -> ServiceClient:
        if self._client is None:
            self._client = ServiceClient.from_env()
        return self._client
