"""An enforcement mode from outside gpupool, as a plugin package would ship it
(tests/node/test_enforcement_plugin.py registers it as an entry point).

``demo`` hands out whole GPUs only, gives each worker a variable of its own,
and runs on simulated GPUs, so a test needs no GPU to see it end to end.
"""

from __future__ import annotations

from gpupool.node.enforcement import EnforcementMode


class Demo(EnforcementMode):
    name = "demo"
    whole_gpus = True
    runs_simulated = True

    def environment(self, gpus, fraction, memory, lease_id, owner, node):
        return {**super().environment(gpus, fraction, memory, lease_id, owner, node),
                "DEMO_ENFORCEMENT": f"{node}/{lease_id}"}
