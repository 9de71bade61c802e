"""A worker launcher from outside gpupool, as a plugin package would ship it
(tests/node/test_launcher_plugin.py registers it as an entry point).

``demo`` is the stock local launcher that also notes every worker it starts,
``HOW PID NAME`` a line, in ``STATE_DIR/demo-launcher.log``: a test can then
tell which workers it started. A container launcher would subclass
:class:`~gpupool.node.workers.launchers.WorkerLauncher` instead.
"""

from __future__ import annotations

from gpupool.node.workers.launchers.local import LocalLauncher

NOTES = "demo-launcher.log"


class DemoLauncher(LocalLauncher):
    async def cold(self, spec):
        return self._noted("cold", await super().cold(spec))

    async def warm(self):
        return self._noted("warm", await super().warm())

    def _noted(self, how, worker):
        with open(self.settings.state_dir / NOTES, "a", encoding="utf-8") as notes:
            notes.write(f"{how} {worker.pid} {worker.name}\n")
        return worker
