"""The service's defaults a replay runs with (``c.PoolLeases.*``, ``c.PoolPressure.*``), seconds (and one switch).

Copies, not reads: the settings (:class:`gpupool.hub_plugin.config.PoolLeases`, ``PoolPressure``)
are traitlets ``Configurable`` classes, whose import pulls in logging's
socket handlers, and the replay imports no I/O module
(``tests/rules/test_simulator.py``). ``tests/rules/test_simulate_parking.py`` checks
every value here against the settings' own defaults, so a changed default
fails there until it is changed here too.
"""

from __future__ import annotations

#: ``c.PoolLeases.idle_timeout``: an idle lease is parked this long after its last cell.
IDLE_TIMEOUT_S = 1800.0
#: ``c.PoolPressure.pressure_grace``: an idle lease is parked this long after a request pressing on it was asked.
PRESSURE_GRACE_S = 120.0
#: ``c.PoolPressure.preemption_notice``: a preemptible cell is told this long before it is interrupted.
PREEMPTION_NOTICE_S = 30.0
#: ``c.PoolLeases.reclaim_interval``: seconds between two sweeps.
RECLAIM_INTERVAL_S = 5.0
#: ``c.PoolLeases.heartbeat_ttl``.
HEARTBEAT_TTL_S = 60.0
#: ``c.PoolLeases.resume_moves``: a parked lease whose own node has no room resumes on another node (a cold
#: move: its state from its node's disk to a new worker there) instead of waiting for its node.
RESUME_MOVES = True

#: Each constant above and the setting it copies.
SETTINGS = {"idle_timeout": IDLE_TIMEOUT_S, "pressure_grace": PRESSURE_GRACE_S,
            "preemption_notice": PREEMPTION_NOTICE_S, "reclaim_interval": RECLAIM_INTERVAL_S,
            "heartbeat_ttl": HEARTBEAT_TTL_S, "resume_moves": RESUME_MOVES}
