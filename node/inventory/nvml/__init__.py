"""Real GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``), read by
the agent in a helper process it replaces when a driver call hangs
(docs/code.md, "nvml/"). Nothing is imported here, so that starting the
helper loads only what it needs.
"""
