"""gpupool: GPU pooling for Jupyter.

The top-level package holds what every part shares: the wire schema
(:mod:`gpupool.schema`), human units (:mod:`gpupool.units`), the error type
(:mod:`gpupool.errors`), the HTTP client of the pool service
(:mod:`gpupool.api`) and the ``gpupool`` command line (:mod:`gpupool.cli`).
It imports none of the subpackages.
"""

__version__ = "0.1.0"
