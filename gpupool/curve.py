"""CurveZMQ on the client side of a worker's sockets.

A worker started with transport encryption (``c.NodeAgent.transport_encryption
= "curve"``) binds its five sockets as CurveZMQ servers with a key pair of its
own; the connection info its owner gets carries only the *public* key,
``curve_publickey`` (Z85 text). A client then sets that key as the server key
and uses a fresh key pair of its own, so the worker's secret key never leaves
its node. (jupyter_client's own clients instead reuse the server's key pair,
which needs the secret key: fine for the agent, which holds it, not for a
notebook on another host.)
"""

from __future__ import annotations

from typing import Any, Mapping

import zmq

#: The connection-info field naming the worker's CurveZMQ public key.
SERVER_KEY = "curve_publickey"


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
