"""The service's pure rules: placement (:mod:`.scheduler`, :mod:`.placement_index`,
:mod:`.workload`, :mod:`.hosts`, :mod:`.fragmentation`), queue order
(:mod:`.queue`), request classes and pressure (:mod:`.priority`,
:mod:`.pressure`), the queue's ETA (:mod:`.eta`), quota arithmetic
(:mod:`.quotas`) and the reclaim decision (:mod:`.reclaim`).

No SQL, no sockets, no clock reads: state and ``now`` in, decisions out. The
service's loops (:mod:`gpupool.hub_plugin.leases`, ``reclaim``, ``pressure``)
call them with what they read from the store; the simulator
(:mod:`gpupool.hub_plugin.simulate`) replays them on a virtual clock.
"""
