"""gpupool: GPU pooling for Jupyter. The top-level package holds what every
part shares: the wire schema, units, errors, the HTTP client, kernel
connections and the ``gpupool`` command line (docs/code.md). It imports none
of the subpackages.
"""

__version__ = "0.1.0"
