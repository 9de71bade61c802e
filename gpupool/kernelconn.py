"""Connections to a worker kernel: the one place that turns a worker's Jupyter
connection info into a signing ``Session`` and ZeroMQ sockets, so every
client chooses socket types, linger, address and CurveZMQ the same way. A
client uses the worker's public key and a fresh key pair of its own, so the
worker's secret key never leaves its node (docs/security.md, "Transport").
Only the connecting is done here: nothing runs per message.
"""

from __future__ import annotations

from typing import Any, Mapping

import zmq
from jupyter_client.session import Session

#: The connection-info field naming the worker's CurveZMQ public key.
SERVER_KEY = "curve_publickey"

#: The socket type of a client of each channel of a Jupyter kernel (its port
#: is the connection info's ``{channel}_port``).
CHANNELS = {"shell": zmq.DEALER, "control": zmq.DEALER, "stdin": zmq.DEALER, "iopub": zmq.SUB, "hb": zmq.REQ}


def kernel_session(connection: Mapping[str, Any], **options: Any) -> Session:
    """The ``Session`` that signs and checks messages of the worker in
    ``connection``: its ``key`` (str or bytes) and ``signature_scheme``
    (default ``hmac-sha256``); ``options`` go to ``Session`` as they are
    (``username``)."""
    key = connection["key"]
    return Session(key=key.encode() if isinstance(key, str) else key,
                   signature_scheme=connection.get("signature_scheme", "hmac-sha256"), **options)


def connect_channel(context: zmq.Context, connection: Mapping[str, Any], channel: str, *,
                    identity: bytes | None = None, topic: bytes = b"") -> zmq.Socket:
    """A socket of ``context`` (sync or ``zmq.asyncio``; the socket is of its
    kind) connected to ``channel`` (a key of :data:`CHANNELS`) of the worker in
    ``connection`` (``ip``, ``transport`` (default ``tcp``), ``{channel}_port``,
    and ``curve_publickey`` when the worker encrypts). The socket lingers 0 s;
    ``identity`` is set when given; an ``iopub`` socket subscribes to
    ``topic`` (default: everything).

    Raises KeyError for an unknown channel or a missing port, and
    :class:`zmq.ZMQError` as :func:`secure` does.
    """
    kind = CHANNELS[channel]
    sock = context.socket(kind)
    sock.linger = 0
    if identity is not None:
        sock.identity = identity
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, topic)
    secure(sock, connection)
    sock.connect(f"{connection.get('transport', 'tcp')}://{connection['ip']}:{connection[f'{channel}_port']}")
    return sock


def secure(sock: zmq.Socket, connection: Mapping[str, Any]) -> zmq.Socket:
    """Make ``sock`` a CurveZMQ client of the worker in ``connection`` when it
    has a ``curve_publickey`` (str or bytes, Z85); a no-op when it has none
    (a worker without encryption). Call before ``connect``; returns ``sock``.

    Raises :class:`zmq.ZMQError` when libzmq lacks CURVE support, or when the
    key is not 40 Z85 characters.
    """
    server_key = connection.get(SERVER_KEY)
    if not server_key:
        return sock
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = server_key.encode("ascii") if isinstance(server_key, str) else server_key
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    return sock
