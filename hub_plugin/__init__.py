"""The pool service: REST API, scheduler, idle reclaim and the SQL store.

Start it with ``gpupool service`` (:mod:`.app`); configure it with
``c.GPUPool.*`` (:mod:`.config`). The scheduler (:mod:`.scheduler`) and the
reclaim rules (:mod:`.reclaim`) are pure; state changes of leases happen in
:mod:`.leases` only.
"""
