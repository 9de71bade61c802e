"""gpupool: GPU pooling for Jupyter.

The top-level package holds what every part shares: the wire schema
(:mod:`gpupool.wire` for every body between the parts, :mod:`gpupool.schema`
for the units and field rules they use), human units (:mod:`gpupool.units`), the
error type (:mod:`gpupool.errors`), the one JSON-over-HTTP client with its
blocking and async transports (:mod:`gpupool.httpout`) and the pool
service's client on it (:mod:`gpupool.api`), the connections to a worker
kernel (:mod:`gpupool.kernelconn`) and the ``gpupool`` command line
(:mod:`gpupool.cli`).
It imports none of the subpackages.
"""

__version__ = "0.1.0"
