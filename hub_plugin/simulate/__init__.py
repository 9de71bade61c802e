"""``gpupool simulate``: trace-driven replay of the service's pure rules
(:mod:`gpupool.hub_plugin.rules`) on a virtual clock, for capacity planning.

The replay (:mod:`.notebooks` with :mod:`.policies`, :mod:`.sweep`,
:mod:`.waiting`, :mod:`.backlog`, :mod:`.eta_log`, :mod:`.results`, park in
place's :mod:`.parked` and :mod:`.costs`, the service's :mod:`.defaults`; the
cluster fill :mod:`.openb` and :mod:`.multidim`; :mod:`.pool`,
:mod:`.workload`, :mod:`.estimates`, :mod:`.synthetic`) imports only the
rules and numpy: no SQL, no sockets, no files. What reads the world sits
beside it: :mod:`.traces` (the public CSV traces), :mod:`.store` (a pool's
recorded leases, SQLAlchemy) and :mod:`.cli` (the command).
"""
