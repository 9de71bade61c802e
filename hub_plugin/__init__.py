"""The pool service: REST API, scheduler, idle reclaim and the SQL store.
Started by ``gpupool service`` (:mod:`.app`), set by ``c.GPUPool.*``,
``c.PoolNodes.*``, ``c.PoolLeases.*``, ``c.PoolPressure.*`` and ``c.PoolQuotas.*``
(:mod:`.config`); its pure rules are :mod:`.rules`, their replay
:mod:`.simulate`, and lease state changes happen in :mod:`.leases` only.
"""
