"""Real GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``).

- :mod:`.inventory`: :class:`~.inventory.NVMLInventory`, NVML read in this
  process, built from :mod:`.calls` (queries that fail softly),
  :mod:`.devices` (the GPUs and MIG instances), :mod:`.processes` and
  :mod:`.events` (Xid events);
- :mod:`.helper`: the helper process the agent reads NVML in
  (``python -m gpupool.provisioner.inventory.nvml.helper FD``);
- :mod:`.watch`: :class:`~.watch.WatchedInventory`, the agent's side of it,
  which replaces a helper whose driver call hangs.

Nothing is imported here, so that starting the helper loads only what it needs.
"""
