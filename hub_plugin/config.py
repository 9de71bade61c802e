"""The pool service's settings: ``c.GPUPool.*`` in ``gpupool_config.py`` or
``jupyterhub_config.py``.

Each setting is a trait whose help gives the unit, the default and an
example. Durations and sizes accept human units (``"30m"``, ``"512MiB"``)
through :mod:`gpupool.traits`; the value stored is seconds or bytes.

The settings are grouped by concern into the classes :class:`GPUPool`
inherits, one from the other (:data:`SETTINGS_PARTS`), so every one stays
``c.GPUPool.NAME``; ``ServiceApp`` shows them all under ``GPUPool`` in
``--generate-config`` and ``--help-all``.
"""

from __future__ import annotations

from traitlets import Bool, Dict, Enum, Float, Integer, List, Set, TraitError, Union, Unicode, validate
from traitlets.config import Configurable

from gpupool.traits import ByteSize, Duration


class ServiceSettings(Configurable):
    """Where the service keeps its state and how it is reached: the store, its
    URL, TLS, the tokens it takes, and how long a request may take."""

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
        ``c.GPUPool.api_tokens = {"3f9a...": "ann"}``.""",
    ).tag(config=True)

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


class NodeAndWorkerSettings(ServiceSettings):
    """How the service deals with node agents: their heartbeats, its calls to
    start and stop workers, and what of each GPU and host it shares out."""

    node_heartbeat_interval = Duration(
        5.0,
        help="""Seconds between two heartbeats of each agent; returned to agents at
        registration. Default: 5 seconds. ``c.GPUPool.node_heartbeat_interval = 10``.""",
    ).tag(config=True)

    node_ttl = Duration(
        30.0,
        help="""Seconds without a heartbeat after which a node is ``lost``: nothing
        new is placed there until it is heard from again. Default: 30 seconds;
        keep it several times ``node_heartbeat_interval``. ``c.GPUPool.node_ttl = "1m"``.""",
    ).tag(config=True)

    worker_start_timeout = Duration(
        60.0,
        help="""Seconds the service waits for an agent to start a worker before
        the lease fails. Default: 60 seconds. ``c.GPUPool.worker_start_timeout = "2m"``.""",
    ).tag(config=True)

    worker_stop_timeout = Duration(
        20.0,
        help="""Seconds the service waits for an agent to stop a worker on
        release; after that the lease still ends (its reason says the stop was
        not confirmed), and the agent is told to stop the worker with its next
        heartbeat. Keep it above the agents' ``c.NodeAgent.worker_stop_timeout``
        (10 s) and below the clients' 30 s timeout, so that a release answers
        before ``%gpu release`` gives up. Default: 20 seconds.
        ``c.GPUPool.worker_stop_timeout = 25``.""",
    ).tag(config=True)

    context_overhead = ByteSize(
        512 * 1024**2,
        help="""Bytes of GPU memory a CUDA context costs, subtracted from each
        GPU's memory before it is shared out. Default: 512 MiB.
        ``c.GPUPool.context_overhead = "1GiB"``.""",
    ).tag(config=True)

    host_share = Float(
        1.0,
        help="""Host CPUs and RAM a lease gets when its request names none
        (``%gpu acquire 0.5`` without ``--cpus`` / ``--host-memory``), as a
        multiple of its GPU share of the node: half a GPU on a node of 8 GPUs,
        64 cores and 512 GiB is 1/16 of it, 4 cores and 32 GiB at 1.0. In
        (0, 1]; below 1 leaves host room for leases that ask for more.
        Default: 1.0 (proportional). ``c.GPUPool.host_share = 0.5``.""",
    ).tag(config=True)

    @validate("host_share")
    def _check_host_share(self, proposal):
        if not 0 < proposal.value <= 1:
            raise TraitError(f"c.GPUPool.host_share must be in (0, 1], got {proposal.value!r}")
        return proposal.value


class LeaseSettings(NodeAndWorkerSettings):
    """How long a lease lives and waits: idle and heartbeat reclaim, the
    queue's wait, parking under pressure, preemption."""

    idle_timeout = Duration(
        30 * 60.0,
        help="""Seconds an attached worker may sit idle (no cell running) before
        its lease is reclaimed, when the request names none. Default: 30 minutes.
        ``c.GPUPool.idle_timeout = "1h"``.""",
    ).tag(config=True)

    max_idle_timeout = Duration(
        24 * 3600.0,
        help="""Largest idle timeout a request may ask for, in seconds; a larger
        one is refused with 400. Default: 24 hours. ``c.GPUPool.max_idle_timeout = "8h"``.""",
    ).tag(config=True)

    idle_warning = Union(
        [Duration(), Enum([0])], default_value=60.0,
        help="""Seconds before an idle lease is reclaimed (or parked by its notebook)
        that the notebook prints a warning under its last cell, once per idle
        period; the lease JSON carries it with ``idle_deadline``. 0 turns the
        warning off. Default: 60 seconds. ``c.GPUPool.idle_warning = "5m"``.""",
    ).tag(config=True)

    heartbeat_ttl = Duration(
        60.0,
        help="""Seconds a lease lives without a heartbeat from its notebook kernel
        (while no cell runs) before it is reclaimed. Default: 60 seconds.
        ``c.GPUPool.heartbeat_ttl = "2m"``.""",
    ).tag(config=True)

    reclaim_interval = Duration(
        5.0,
        help="""Seconds between two reclaim sweeps (idle leases, missing
        heartbeats, lost nodes). Default: 5 seconds. ``c.GPUPool.reclaim_interval = 10``.""",
    ).tag(config=True)

    max_wait = Duration(
        3600.0,
        help="""Longest ``wait`` (seconds) a lease request may ask for: a request that
        does not fit waits in the queue that long, then ends ``failed``. A longer wait is
        refused with 400. Default: 1 hour. ``c.GPUPool.max_wait = "4h"``.""",
    ).tag(config=True)

    pressure_grace = Duration(
        120.0,
        help="""Seconds an idle over-quota lease may stay idle while requests wait in
        the queue before it is parked early (instead of after its idle timeout):
        batch leases first, then the longest idle, until what they free covers
        the queue; a lease within its owner's ``guaranteed_gpus`` is never parked
        early, a lease whose cell runs never (docs/api.md, "Pressure"). Counted
        from when it went idle or when the oldest waiting request was asked,
        whichever is later. Default: 2 minutes. ``c.GPUPool.pressure_grace = "5m"``.""",
    ).tag(config=True)

    allow_preemption = Bool(
        True,
        help="""Whether leases may opt in to preemption (``%gpu acquire --preemptible``):
        under pressure such a lease's running cell is interrupted (after a notice of
        ``preemption_notice``) and the lease parked. False refuses ``preemptible``
        requests with 400 naming this setting. Default: True.
        ``c.GPUPool.allow_preemption = False``.""",
    ).tag(config=True)

    preemption_notice = Duration(
        30.0,
        help="""Seconds a preemptible lease is told ahead before its running cell is
        interrupted (on top of ``pressure_grace``, counted from when the oldest
        waiting request was asked; the notebook gives at least this much after it
        first hears of it). Default: 30 seconds. ``c.GPUPool.preemption_notice = "2m"``.""",
    ).tag(config=True)

    preemption_grace = Union(
        [Duration(), Enum([0])], default_value=None, allow_none=True,
        help="""Seconds from when the oldest waiting interactive request was asked until
        a preemptible lease's running cell is told it will be preempted (it is then
        interrupted ``preemption_notice`` later). ``None`` means ``pressure_grace``; 0
        tells it at once, so the notice alone is its warning and a waiting person gets
        the GPU within a sweep or two. Default: None (``pressure_grace``).
        ``c.GPUPool.preemption_grace = 0``.""",
    ).tag(config=True)

    batch_first = Bool(
        False,
        help="""Under pressure, take batch leases before interactive ones whatever their
        state: a running preemptible batch lease is preempted before a person's idle
        notebook is parked early. False keeps the order idle leases first (batch, then
        the longest idle), then running preemptible ones. Default: False.
        ``c.GPUPool.batch_first = True``.""",
    ).tag(config=True)

    batch_yields = Bool(
        False,
        help="""Place no batch request (new or queued) while an interactive request waits:
        what frees up, or what pressure frees, goes to the person, not to backfill. A new
        batch request is then queued (with ``wait``) or refused (409 ``pool_full``). False:
        batch fills whatever interactive requests cannot use. Default: False.
        ``c.GPUPool.batch_yields = True``.""",
    ).tag(config=True)

    batch_headroom_nodes = Integer(
        0, min=0,
        help="""Nodes kept idle for interactive requests for whole nodes: a batch request is
        not placed on a node with nothing allocated while only this many (or fewer) nodes
        have nothing allocated. Default: 0 (none kept). ``c.GPUPool.batch_headroom_nodes = 1``.""",
    ).tag(config=True)

    pressure_clears_nodes = Bool(
        False,
        help="""For a waiting interactive request for several whole GPUs (``%gpu acquire 8``),
        pressure clears one node that can hold it: of the nodes where wholly free GPUs plus
        what pressure may take (idle leases, and running preemptible ones) cover the ask, the
        one where no person's idle notebook is parked, then the one stopping the fewest running
        GPUs. False counts what waits in GPUs pool-wide, which may free a GPU on each of several
        nodes and none that fits. Default: False. ``c.GPUPool.pressure_clears_nodes = True``.""",
    ).tag(config=True)

    pressure_clear_grace = Union(
        [Duration(), Enum([0])], default_value=None, allow_none=True,
        help="""With ``pressure_clears_nodes``: seconds after a waiting interactive request for
        several whole GPUs was asked at which an idle lease on the node cleared for it is parked
        (when the lease goes idle later: as soon as it does), instead of ``pressure_grace``. A
        person asking for a whole node then waits seconds, not minutes, for a notebook idle on
        it; a lease whose cell runs is still never touched. ``None`` means ``pressure_grace``.
        Default: None. ``c.GPUPool.pressure_clear_grace = 5``.""",
    ).tag(config=True)


class QuotaSettings(LeaseSettings):
    """What each user may hold: quotas per user and group, the groups, the
    time zone usage is counted in, and the caps on leases and queued requests."""

    quotas = Dict(
        help="""Limits per user, per group and a default; see ``gpupool/hub_plugin/rules/quotas.py``
        and docs/api.md ("Quotas"). Keys are ``"*"``, ``"group:NAME"`` and ``"user:NAME"``;
        values dicts of ``max_gpus`` (GPUs held at once, sum of fractions), ``max_lease_gpus``
        (size of one lease), ``gpu_hours_per_day``, ``gpu_hours_per_week`` (hours, or
        ``"90m"``), ``max_idle_timeout`` (seconds or ``"2h"``); ``None`` means unlimited.
        A user's own entry beats their groups', the most generous group beats the
        default. Admins may override entries at run time (``gpupool quota set``).
        Default: no limits.
        ``c.GPUPool.quotas = {"*": {"max_gpus": 1, "gpu_hours_per_day": 8},
        "group:quants": {"max_gpus": 4}, "user:ann": {"max_idle_timeout": "4h"}}``.""",
    ).tag(config=True)

    @validate("quotas")
    def _read_quotas(self, proposal):
        from .rules.quotas import parse_table

        try:
            return parse_table(proposal["value"])
        except ValueError as exc:
            raise TraitError(f"c.GPUPool.quotas: {exc}") from None

    groups = Dict(
        key_trait=Unicode(), value_trait=List(Unicode()),
        help="""Standalone group membership, group name -> user names, for quotas.
        Under JupyterHub the hub's groups are used, and these are added to them.
        Default: none. ``c.GPUPool.groups = {"quants": ["ann", "bob"]}``.""",
    ).tag(config=True)

    usage_timezone = Unicode(
        "UTC",
        help="""IANA time zone in which usage days and weeks (Monday first) are counted
        for ``gpu_hours_per_day`` / ``gpu_hours_per_week``; times are stored as UTC.
        Default: ``UTC``. ``c.GPUPool.usage_timezone = "Europe/Berlin"``.""",
    ).tag(config=True)

    @validate("usage_timezone")
    def _known_zone(self, proposal):
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(proposal["value"])
        except (ZoneInfoNotFoundError, ValueError):
            raise TraitError(f"c.GPUPool.usage_timezone: unknown time zone {proposal['value']!r}; "
                             "use an IANA name such as 'UTC' or 'Europe/Berlin'") from None
        return proposal["value"]

    max_active_per_user = Integer(
        10, allow_none=True, min=1,
        help="""Most leases one user may hold at once (``starting`` or ``active``), whatever
        their size (the GPU amounts are the quotas' business, ``max_gpus``); one more is
        refused with 429 ``quota_exceeded`` (``limit``: ``max_active_per_user``), and a queued
        request of a user at the cap waits until one of theirs ends. ``None``: no cap.
        Default: 10. ``c.GPUPool.max_active_per_user = 20``.""",
    ).tag(config=True)

    max_queued_per_user = Integer(
        10, allow_none=True, min=1,
        help="""Most requests one user may have waiting in the queue (``wait``) at once;
        one more is refused with 429 ``quota_exceeded`` (``limit``: ``max_queued_per_user``).
        It keeps one user from filling the queue that everyone's placement reads. ``None``:
        no cap. Default: 10. ``c.GPUPool.max_queued_per_user = 50``.""",
    ).tag(config=True)


# Its settings (c.GPUPool.*) are those of the four classes above, which it inherits.
class GPUPool(QuotaSettings):
    """Settings of the pool service (scheduler, reclaim, store, tokens)."""


#: The classes whose settings :class:`GPUPool` inherits: shown as ``c.GPUPool.*``, not on their own.
SETTINGS_PARTS = (ServiceSettings, NodeAndWorkerSettings, LeaseSettings, QuotaSettings)
