"""The service's own settings: store, URL, TLS, tokens, request time limits (``c.GPUPool.*``)."""

from __future__ import annotations

from traitlets import Bool, Dict, Set, TraitError, Unicode, validate
from traitlets.config import Configurable

from gpupool.traits import Duration

#: The longest user name a token may name: what a worker's owner may be (``gpupool.wire.workers``).
MAX_USER_NAME = 200


class GPUPool(Configurable):
    """Where the service keeps its state and how it is reached: the store, its
    URL, TLS, the tokens it takes, and how long a request may take. The
    service's other settings have a class each (:mod:`.nodes`, :mod:`.leases`,
    :mod:`.pressure`, :mod:`.quotas`)."""

    db_url = Unicode(
        "sqlite:///{state_dir}/gpupool.sqlite",
        help="""SQLAlchemy URL of the store. ``{state_dir}`` is replaced by the
        service's state directory. Default: ``sqlite:///{state_dir}/gpupool.sqlite``.
        PostgreSQL (production) through psycopg 3:
        ``c.GPUPool.db_url = "postgresql+psycopg://gpupool@db/gpupool"``.""",
    ).tag(config=True)

    base_url = Unicode(
        "/",
        help="""URL prefix the service is served under; under JupyterHub this is
        the service prefix. Default: ``/``. ``c.GPUPool.base_url = "/services/gpupool/"``.""",
    ).tag(config=True)

    @validate("base_url")
    def _slashes(self, proposal):
        return "/" + proposal["value"].strip("/") + "/" if proposal["value"].strip("/") else "/"

    public_url = Unicode(
        "",
        help="""The URL notebook kernels and node agents use to reach the service,
        with ``base_url`` as its path, when it is not the address the service binds
        (``--ip``, ``--port``): a host name, a load balancer, a Kubernetes Service.
        Across hosts make it ``https://`` (serve ``ssl_cert``/``ssl_key``; give clients
        ``GPUPOOL_CA_FILE`` for your own CA): tokens travel in every request.
        Default: empty, meaning the bound address (``http://127.0.0.1:8765/`` for a
        wildcard bind). Written to ``STATE_DIR/service.json`` as ``public_url``.
        ``c.GPUPool.public_url = "https://pool.example.org:8765/"``.""",
    ).tag(config=True)

    @validate("public_url")
    def _public_url_valid(self, proposal):
        from urllib.parse import urlsplit

        url = proposal["value"]
        if url and (urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname):
            raise TraitError(f"c.GPUPool.public_url must be an http:// or https:// URL with a host, got {url!r}")
        return url.rstrip("/") + "/" if url else url

    ssl_cert = Unicode(
        "",
        help="""TLS certificate (PEM, with its chain) the service serves HTTPS with;
        set with ``ssl_key``. Default: empty (plain HTTP). Clients verify it: give them
        ``GPUPOOL_CA_FILE`` when your own CA signed it. ``gpupool service --ssl-cert=F``,
        ``c.GPUPool.ssl_cert = "/etc/gpupool/tls.crt"``.""",
    ).tag(config=True)

    ssl_key = Unicode(
        "",
        help="""Private key (PEM, unencrypted) of ``ssl_cert``. Default: empty.
        ``gpupool service --ssl-key=F``, ``c.GPUPool.ssl_key = "/etc/gpupool/tls.key"``.""",
    ).tag(config=True)

    ca_file = Unicode(
        "",
        help="""CA bundle (PEM) the service trusts, besides the system's CAs, when it
        calls agents that serve HTTPS. Default: empty, or ``$GPUPOOL_CA_FILE``.
        ``gpupool service --ca-file=F``, ``c.GPUPool.ca_file = "/etc/gpupool/ca.crt"``.""",
    ).tag(config=True)

    api_tokens = Dict(
        key_trait=Unicode(), value_trait=Unicode(),
        help="""Standalone user tokens, token -> user name. Default: empty, in
        which case the service creates one token for the OS user running it
        and writes it to ``STATE_DIR/user_token`` (mode 0600).
        ``c.GPUPool.api_tokens = {"3f9a...": "ann"}``. Refused at start: an
        empty token, and a user name that is empty, blank or over 200
        characters (what a worker's owner may be).""",
    ).tag(config=True)

    @validate("api_tokens")
    def _tokens_name_users(self, proposal):
        # Checked here, not at the first worker start, where an empty owner is refused (WorkerRequest.owner).
        for token, user in proposal.value.items():
            if not token.strip():
                raise TraitError(f"c.GPUPool.api_tokens: a token is empty (for user {user!r}); use a long random "
                                 "string, such as `openssl rand -hex 32` prints")
            if not user.strip() or len(user) > MAX_USER_NAME:
                raise TraitError(f"c.GPUPool.api_tokens: a token's user name must be 1 to {MAX_USER_NAME} "
                                 f"characters, not blank, got {user[:MAX_USER_NAME]!r}")  # never the token: a secret
        return proposal.value

    admin_users = Set(
        Unicode(),
        help="""User names with admin scope: they may release anyone's lease.
        Default: none. ``c.GPUPool.admin_users = {"ann"}``.""",
    ).tag(config=True)

    agent_token = Unicode(
        "",
        help="""Token the node agents send (``Authorization: token ...``). Default:
        empty, meaning the token kept in ``STATE_DIR/agent_token`` is used, or a
        new one is generated there. The file is always (re)written, mode 0600,
        so agents on this host can read it with ``--token-file``.
        ``c.GPUPool.agent_token = open("/etc/gpupool/agent_token").read().strip()``.""",
    ).tag(config=True)

    hub_auth_cache_max_age = Duration(
        30.0,
        help="""Under JupyterHub: seconds the service keeps the hub's answer about a
        user's token (who it is, its scopes, the user's groups) before asking the
        hub again; JupyterHub's ``HubAuth.cache_max_age``, whose own default is 5
        minutes. A revoked token, a new admin scope or a change of groups reaches
        the pool within this time; shorter asks the hub more often (once per token
        per this time). Default: 30 seconds.
        ``c.GPUPool.hub_auth_cache_max_age = "1m"``.""",
    ).tag(config=True)

    metrics_token_file = Unicode(
        "",
        help="""File holding the token (one line) with which Prometheus reads all of
        ``/metrics``, per-user series included (``gpupool_usage_gpu_seconds_total{user}``);
        give Prometheus the same file as ``authorization: credentials_file``. Other callers
        (any user or agent token, or no token when ``authenticate_prometheus`` is False) get
        the pool-wide series only; admins get all. Default: empty (no metrics token).
        ``c.GPUPool.metrics_token_file = "/etc/gpupool/metrics_token"``.""",
    ).tag(config=True)

    authenticate_prometheus = Bool(
        True,
        help="""Whether ``/metrics`` needs a token (any user or agent token).
        Default: True. ``c.GPUPool.authenticate_prometheus = False``.""",
    ).tag(config=True)

    request_header_timeout = Duration(
        60.0,
        help="""Seconds a connection may take to send a request's headers, and may stay
        open idle between requests; then it is closed (slow or stalled clients hold no
        memory). Default: 60 seconds. ``c.GPUPool.request_header_timeout = "2m"``.""",
    ).tag(config=True)

    request_body_timeout = Duration(
        30.0,
        help="""Seconds a request may take to send its body (at most 1 MiB); then its
        connection is closed. Default: 30 seconds. ``c.GPUPool.request_body_timeout = 60``.""",
    ).tag(config=True)
