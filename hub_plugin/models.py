"""The store's tables (SQLAlchemy 2 declarative). Schema changes go through
an Alembic revision in :mod:`.migrations`.

Times are stored as UTC (naive in the database, since SQLite has no time
zones) and read back as timezone-aware UTC datetimes. Memory is bytes
(BigInteger), fractions are floats, durations seconds.

Capacity is never stored as a counter: what a GPU has allocated is always
the sum over the leases that hold capacity (``LeaseState.holds_capacity``)
and their ``LeaseGPU`` rows, so nothing can leak when a release half-fails.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint,
                        false)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from gpupool.leaseclasses import MAX_NAME as MAX_CLASS_NAME, default as default_class


class UTCDateTime(TypeDecorator):
    """A datetime stored as naive UTC and returned as aware UTC."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=timezone.utc)


class Base(DeclarativeBase):
    pass


def new_lease_id() -> str:
    """``L-`` and 12 random hex digits (docs/api.md)."""
    return "L-" + secrets.token_hex(6)


class Node(Base):
    """A GPU host with an agent. ``state`` is ``up``, ``degraded`` (its agent
    heartbeats but cannot read its GPUs, NVML failed: its leases go on,
    nothing new is placed there) or ``lost`` (no heartbeat for
    ``PoolNodes.node_ttl``: nothing new is placed there); ``state_reason`` says
    why in words when it is not ``up``."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    url: Mapped[str] = mapped_column(String(500))
    inventory: Mapped[str] = mapped_column(String(20))
    enforcement: Mapped[str | None] = mapped_column(String(50))
    #: Revision 0008: its enforcement hands out whole GPUs only (the capacity rule its agent reported).
    whole_gpus: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    state: Mapped[str] = mapped_column(String(10), default="up")
    #: Revision 0004: why the node is degraded or lost (None while up).
    state_reason: Mapped[str | None] = mapped_column(String(500))
    #: Revision 0005: the worker environments its agent offers, as it reported them.
    environments: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    #: Revision 0007: its host's cores and RAM (bytes) as the agent reported them (None: not reported).
    host_cpus: Mapped[float | None] = mapped_column(Float)
    host_memory: Mapped[int | None] = mapped_column(BigInteger)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime)
    #: Revision 0011: the checkpointer its agent parks workers with, as it reported it
    #: (``CheckpointerInfo.to_json()``; None: it cannot park in place), and its budget of host
    #: bytes for parked workers (``c.AgentParking.parked_memory``; None: not reported). The
    #: budget is the agent's to keep (it spills); the service only reads the tiers reported.
    checkpointer: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    parked_memory: Mapped[int | None] = mapped_column(BigInteger)

    gpus: Mapped[list[GPU]] = relationship(back_populates="node", order_by="GPU.index",
                                           cascade="all, delete-orphan")


class GPU(Base):
    """One device of a node, as the agent reported it. ``memory_*`` in bytes;
    ``memory_used`` and ``utilization`` (percent) are the latest NVML readings."""

    __tablename__ = "gpus"

    uuid: Mapped[str] = mapped_column(String(200), primary_key=True)
    node_name: Mapped[str] = mapped_column(ForeignKey("nodes.name", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    index: Mapped[int] = mapped_column(Integer)
    memory_total: Mapped[int] = mapped_column(BigInteger)
    memory_reserved: Mapped[int] = mapped_column(BigInteger, default=0)
    compute_capability: Mapped[str | None] = mapped_column(String(20))
    memory_used: Mapped[int | None] = mapped_column(BigInteger)
    utilization: Mapped[float | None] = mapped_column(Float)
    #: Bytes used by processes of no worker (NVML's readings); placement counts them as taken.
    memory_unattributed: Mapped[int | None] = mapped_column(BigInteger)
    healthy: Mapped[bool] = mapped_column(Boolean, default=True)

    node: Mapped[Node] = relationship(back_populates="gpus")


class Lease(Base):
    """One grant of GPU capacity to one owner; see ``gpupool.schema.LeaseState``.

    ``memory`` is the slice's limit per GPU in bytes; ``idle_timeout`` and
    ``heartbeat_ttl`` seconds; ``connection`` the worker's Jupyter connection
    info (with its HMAC key), kept only while its worker lives (active, and
    parking or parked in memory; cleared by a spill and at the end).
    """

    __tablename__ = "leases"

    id: Mapped[str] = mapped_column(String(20), primary_key=True, default=new_lease_id)
    owner: Mapped[str] = mapped_column(String(200), index=True)
    state: Mapped[str] = mapped_column(String(12), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    # The final state a ``releasing`` lease will reach (released, reclaimed,
    # failed), kept so a release interrupted by a restart ends the same way.
    end_state: Mapped[str | None] = mapped_column(String(12))
    #: Revision 0010: why the service reclaimed it, as a code (``rules.reclaim.Reclaim``: idle,
    #: heartbeat, pressure) beside the words of ``reason``: the metrics count by it, not by the words.
    reclaim_code: Mapped[str | None] = mapped_column(String(20))
    fraction: Mapped[float] = mapped_column(Float)
    gpu_count: Mapped[int] = mapped_column(Integer, default=1)
    memory: Mapped[int] = mapped_column(BigInteger)
    node_name: Mapped[str | None] = mapped_column(ForeignKey("nodes.name"), index=True)
    kernel_id: Mapped[str | None] = mapped_column(String(200), index=True)
    idle_timeout: Mapped[float] = mapped_column(Float)
    heartbeat_ttl: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    idle_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    worker_pid: Mapped[int | None] = mapped_column(Integer)
    worker_state: Mapped[str | None] = mapped_column(String(10))
    #: GPU bytes the worker's process tree uses (NVML, via the agent); None when unknown.
    worker_memory_used: Mapped[int | None] = mapped_column(BigInteger)
    connection: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    usage_gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    # Added by revision 0002 (quotas, usage and the queue):
    #: The owner's groups when the lease was asked for (usage per group).
    groups: Mapped[list[str] | None] = mapped_column(JSON)
    #: What a queued request asked for, kept until it is placed.
    model: Mapped[str | None] = mapped_column(String(200))
    requested_memory: Mapped[int | None] = mapped_column(BigInteger)
    #: A queued request that is still queued at this time ends ``failed``.
    wait_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    #: Revision 0003: the JupyterHub server the lease came from ("" the default
    #: one; None: unknown), so a stopped server's leases are released alone.
    server_name: Mapped[str | None] = mapped_column(String(255))
    #: Revision 0005: the worker environment the request named (None: the node's default);
    #: once placed, the one the worker runs in (the node's default, by name, when the node reports one).
    env: Mapped[str | None] = mapped_column(String(100))
    #: Revision 0006: ``interactive`` or ``batch`` (:mod:`.rules.priority`), and whether
    #: its running cell may be preempted under pressure.
    lease_class: Mapped[str] = mapped_column(String(MAX_CLASS_NAME), default=default_class().name,
                                             server_default=default_class().name)
    preemptible: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    #: Revision 0007: host cores and bytes the lease holds on its node (None: its node reports no host),
    #: and what the request named (None: the default share), kept for the queue.
    cpus: Mapped[float | None] = mapped_column(Float)
    host_memory: Mapped[int | None] = mapped_column(BigInteger)
    requested_cpus: Mapped[float | None] = mapped_column(Float)
    requested_host_memory: Mapped[int | None] = mapped_column(BigInteger)
    #: Revision 0009: when the last cell the agent reported started, whether its
    #: :class:`LeaseCell` is still open (no end seen yet) (:mod:`.cell_log`), and whether this
    #: lease's cells are recorded (false for leases from before the revision).
    cell_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cell_open: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    cells_recorded: Mapped[bool] = mapped_column(Boolean, default=True, server_default=false())
    #: Revision 0011, park in place (docs/parking.md). ``on_idle``: what the idle timeout does
    #: (``park`` or ``release``). ``held_since``: when the lease's current span holding a GPU
    #: share began (its start, then each resume; None before it starts and while it is parked
    #: or resuming): usage counts from it, and each span is one ledger row. ``parked_seconds``:
    #: the seconds spent parked so far, counted apart from usage.
    on_idle: Mapped[str] = mapped_column(String(10), default="park", server_default="park")
    held_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    parked_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    #: The park, while ``parking``, ``parked`` and resuming (``starting`` again; cleared once
    #: ``active``): ``park_tier`` the tier asked for while parking, then the one the agent
    #: reported (``memory``, ``disk``); ``park_code`` why (:class:`.rules.reclaim.ParkCode`:
    #: idle, pressure, preemption, owner) beside ``park_reason``, its words; ``parked_at`` when the
    #: park began, then when it was done (kept through a resume or move that failed);
    #: ``park_checkpointer`` the one that moved the GPU state;
    #: bytes ``parked_host_bytes`` (host RAM held on the node), ``parked_disk_bytes`` (what a
    #: spill wrote), ``gpu_bytes_moved``, ``gpu_bytes_kept`` (still taken on its GPUs, counted
    #: there by placement); ``parked_lost`` what could not be kept, in words; and
    #: ``resume_requested_at``: when a resume was asked for (None: none waits); ``resume_in_place``
    #: (revision 0014): only ahead of a cell so far, so it waits for its own node (never moves).
    park_tier: Mapped[str | None] = mapped_column(String(10))
    park_code: Mapped[str | None] = mapped_column(String(20))
    park_reason: Mapped[str | None] = mapped_column(Text)
    parked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    park_checkpointer: Mapped[str | None] = mapped_column(String(50))
    parked_host_bytes: Mapped[int | None] = mapped_column(BigInteger)
    parked_disk_bytes: Mapped[int | None] = mapped_column(BigInteger)
    gpu_bytes_moved: Mapped[int | None] = mapped_column(BigInteger)
    gpu_bytes_kept: Mapped[int | None] = mapped_column(BigInteger)
    parked_lost: Mapped[list[str] | None] = mapped_column(JSON)
    resume_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    resume_in_place: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    #: Revision 0012: a move's old lease (``LeaseRequest.replaces``), which the quota does not count
    #: while this one starts; the sweep releases it once this one has run for MOVE_GRACE_S.
    replaces: Mapped[str | None] = mapped_column(String(40))
    #: Revision 0013: while a parked lease moves to another node to resume (``starting`` there,
    #: ``c.PoolLeases.resume_moves``), where its state still is: ``{"node": its old node,
    #: "gpus": [{"uuid", "name", "index"}, ...] its old GPUs, "cpus", "host_memory": its old host
    #: reservation}`` (:func:`.parked.moving`); a failed move goes back there. None otherwise.
    moved_from: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    gpus: Mapped[list[LeaseGPU]] = relationship(back_populates="lease", order_by="LeaseGPU.index",
                                                cascade="all, delete-orphan")
    events: Mapped[list[LeaseEvent]] = relationship(back_populates="lease", order_by="LeaseEvent.id",
                                                    cascade="all, delete-orphan")


class LeaseGPU(Base):
    """A GPU a lease holds. Name and index are copied from the GPU so a
    lease's history survives the GPU leaving the pool (no foreign key)."""

    __tablename__ = "lease_gpus"

    lease_id: Mapped[str] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"), primary_key=True)
    gpu_uuid: Mapped[str] = mapped_column(String(200), primary_key=True, index=True)
    name: Mapped[str] = mapped_column(String(200))
    index: Mapped[int] = mapped_column(Integer)

    lease: Mapped[Lease] = relationship(back_populates="gpus")


class LeaseEvent(Base):
    """One state transition of a lease, with its time and reason."""

    __tablename__ = "lease_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[str] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"), index=True)
    state: Mapped[str] = mapped_column(String(12))
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    reason: Mapped[str | None] = mapped_column(Text)

    lease: Mapped[Lease] = relationship(back_populates="events")


class LeaseCell(Base):
    """Revision 0009: one cell a lease's worker ran, from its start to its end
    (None while it runs), as the agent's heartbeats report them (:mod:`.cell_log`);
    what ``gpupool simulate --from-store`` replays."""

    __tablename__ = "lease_cells"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[str] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"), index=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class UsageRecord(Base):
    """The usage ledger: one row per span a lease held a GPU share, written
    once when the span ends (:mod:`.usage`): when the lease is parked, and when
    it ends (a lease that never started gets one row of 0). ``gpus`` is
    fraction x GPU count; ``gpu_seconds`` is ``gpus`` x seconds from
    ``started_at`` to ``ended_at`` (the span's); ``groups`` the owner's groups
    when the lease was asked for. Unique per lease and span start (one row
    per span, not per lease), so parked time is in no row."""

    __tablename__ = "usage_ledger"
    __table_args__ = (UniqueConstraint("lease_id", "started_at", name="uq_usage_ledger_span"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lease_id: Mapped[str] = mapped_column(String(20))
    owner: Mapped[str] = mapped_column(String(200), index=True)
    groups: Mapped[list[str] | None] = mapped_column(JSON)
    gpus: Mapped[float] = mapped_column(Float)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    gpu_seconds: Mapped[float] = mapped_column(Float)


class QuotaOverride(Base):
    """A quota set at run time (admin API, ``gpupool quota set``) for one
    scope (``*``, ``group:NAME``, ``user:NAME``): ``limits`` are merged over
    ``c.PoolQuotas.quotas[scope]``, limit by limit (:mod:`.rules.quotas`)."""

    __tablename__ = "quota_overrides"

    scope: Mapped[str] = mapped_column(String(210), primary_key=True)
    limits: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_by: Mapped[str] = mapped_column(String(200))
