"""The pool service: REST API, scheduler, idle reclaim and the SQL store.

Start it with ``gpupool service`` (:mod:`.app`); configure it with
``c.GPUPool.*`` (:mod:`.config`). The rules (placement, queue order, classes
and pressure, quotas, the reclaim decision) are pure and live in
:mod:`.rules`; the simulator that replays them is :mod:`.simulate`. State
changes of leases happen in :mod:`.leases` only.
"""
