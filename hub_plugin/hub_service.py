"""The service side of running under JupyterHub: who calls, and the browser login.

When the hub starts ``gpupool service`` as a managed service it passes
``JUPYTERHUB_API_TOKEN``, ``JUPYTERHUB_API_URL``, ``JUPYTERHUB_SERVICE_PREFIX``,
``JUPYTERHUB_CLIENT_ID`` and ``JUPYTERHUB_OAUTH_*`` in the environment;
``jupyterhub.services.auth.HubOAuth`` reads them itself. One ``HubOAuth``
serves both API tokens (``user_for_token``) and the admin page's OAuth
cookie. The hub side (``jupyterhub_config.py``) is :mod:`.hub`.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from typing import Any

from .auth import HubAuthenticator, in_jupyterhub
from .config import GPUPool

log = logging.getLogger("gpupool.service.hub")

__all__ = ["in_jupyterhub", "authentication"]


def authentication(agent_token: str, base_url: str,
                   cache_max_age: float = GPUPool.hub_auth_cache_max_age.default_value,
                   ) -> tuple[HubAuthenticator, dict[str, Any]]:
    """The authenticator and the extra tornado settings (``hub_auth`` for
    ``HubOAuthenticated`` handlers, a fresh ``cookie_secret``: a restart only
    sends browsers through the hub's OAuth again, which needs no password).
    ``cache_max_age``: seconds HubAuth keeps the hub's answer about a token
    (``c.GPUPool.hub_auth_cache_max_age``; HubAuth's own default, 300, let a
    revoked token work for five minutes).

    Called at start-up when :func:`in_jupyterhub`; warns when
    ``c.GPUPool.base_url`` is not the hub's service prefix, since the proxy
    forwards the full path and no route would match.
    """
    from jupyterhub.services.auth import HubOAuth

    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX")
    if prefix and prefix != base_url:
        log.warning("c.GPUPool.base_url is %s but JupyterHub serves this service under %s; set "
                    "c.GPUPool.base_url = %r (gpupool.hub_plugin.hub.configure does)", base_url, prefix, prefix)
    hub_auth = HubOAuth(base_url=prefix or base_url, cache_max_age=int(math.ceil(cache_max_age)))
    log.info("authenticating users with JupyterHub at %s (service %s; its answers kept %ss)", hub_auth.api_url,
             os.environ.get("JUPYTERHUB_SERVICE_NAME", "?"), hub_auth.cache_max_age)
    return HubAuthenticator(hub_auth, agent_token), {"hub_auth": hub_auth,
                                                     "cookie_secret": secrets.token_bytes(32)}
