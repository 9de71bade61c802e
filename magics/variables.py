"""The notebook's side of moved variables: its namespace, and the device each
value pulled off an accelerator came from, so that it goes back there when it
is next sent (a release keeps the worker's state: GPU tensors come home on the CPU)."""

from __future__ import annotations

import sys
from typing import Any

from gpupool.transfer import describe

from .attachment import Attachment
from .namespace import local_candidates
from .words import say


class Variables:
    """Values into and out of the user's namespace ``shell.user_ns``."""

    def __init__(self, shell) -> None:
        self.shell = shell
        # name -> (id of the local value, device it was on)
        self.devices: dict[str, tuple[int, str]] = {}

    def undefined(self, names: list[str]) -> list[str]:
        """Those of ``names`` not defined in the user's namespace."""
        return [n for n in names if n not in self.shell.user_ns]

    def take(self, values: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Put pulled ``values`` into the user's namespace, remembering the
        device of each that came off an accelerator."""
        self.shell.user_ns.update(values)
        for item in items:
            name = item["name"]
            if item.get("device") and name in values:
                self.devices[name] = (id(values[name]), item["device"])
            else:
                self.devices.pop(name, None)

    def send(self, attachment: Attachment, names: list[str]):
        """Push local ``names`` with the devices remembered for them (only while
        the local value is still the one that was pulled); returns
        :meth:`Attachment.push`'s ``(items, errors)``."""
        values = {n: self.shell.user_ns[n] for n in names}
        devices = {n: self.devices[n][1] for n in names if n in self.devices and self.devices[n][0] == id(values[n])}
        return attachment.push(values, devices)

    def follow(self, attachment: Attachment, cell: str) -> None:
        """Send along the local names ``cell`` reads that the worker lacks, with
        a one-line note; one line per value that cannot be sent."""
        candidates = local_candidates(cell, self.shell.user_ns, self.shell.user_ns_hidden)
        if not candidates:
            return
        have = attachment.have(candidates)
        missing = [n for n in candidates if n not in have]
        if not missing:
            return
        items, errors = self.send(attachment, missing)
        if items:
            say(f"sent along {describe(items)}")
        for name, why in errors.items():
            print(f"gpupool: could not send {name}: {why}", file=sys.stderr, flush=True)
