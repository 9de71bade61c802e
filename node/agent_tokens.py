"""The agent's tokens: the agent token, which it sends to the service and
which the service's calls to it carry, and the optional metrics token that
Prometheus sends to ``GET /metrics``."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from gpupool.errors import GPUPoolError, Reason

TOKEN_ENV = "GPUPOOL_AGENT_TOKEN"


class AgentTokens:
    """Both tokens, read at construction from ``token_file`` (or
    GPUPOOL_AGENT_TOKEN when empty) and ``metrics_token_file`` (empty: no
    metrics token). Raises GPUPoolError ``not_configured`` naming the file."""

    def __init__(self, token_file: str, metrics_token_file: str) -> None:
        self.token_file, self.metrics_token_file = token_file, metrics_token_file
        self.token = self.read()
        self.metrics_token = self._read_metrics_token()

    def read(self) -> str:
        """Read the agent token again and return it; done before each
        registration, so a rotated token is picked up."""
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise GPUPoolError(Reason.not_configured, f"cannot read the agent token file {self.token_file}: "
                                   f"{exc.strerror} (--token-file)") from None
        else:
            token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise GPUPoolError(Reason.not_configured, "no agent token: pass --token-file=FILE (the service writes "
                               f"STATE_DIR/agent_token) or set {TOKEN_ENV}")
        self.token = token
        return token

    def _read_metrics_token(self) -> str:
        if not self.metrics_token_file:
            return ""
        try:
            return Path(self.metrics_token_file).read_text().strip()
        except OSError as exc:
            raise GPUPoolError(Reason.not_configured, f"cannot read the metrics token file {self.metrics_token_file}: "
                               f"{exc.strerror} (--metrics-token-file)") from None

    def agent_matches(self, header: str) -> bool:
        """True when an ``Authorization: token ...`` header carries the agent token."""
        return _carries(header, self.token)

    def metrics_matches(self, header: str) -> bool:
        """True when the header carries the metrics token (never when none is set)."""
        return bool(self.metrics_token) and _carries(header, self.metrics_token)


def _carries(header: str, token: str) -> bool:
    scheme, _, value = header.partition(" ")
    return scheme.lower() in ("token", "bearer") and hmac.compare_digest(value.strip().encode(), token.encode())
