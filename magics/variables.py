"""The notebook's side of moved variables: its namespace, and the device each
value pulled off an accelerator came from, so that it goes back there when it
is next sent (a release keeps the worker's state: GPU tensors come home on the CPU)."""

from __future__ import annotations

import sys
from typing import Any

from gpupool.transfer import describe, output_count

from .attachment import Attachment
from .namespace import local_candidates, names_bound
from .words import say


class Variables:
    """Values into and out of the user's namespace ``shell.user_ns``."""

    def __init__(self, shell) -> None:
        self.shell = shell
        # name -> (id of the local value, device it was on)
        self.devices: dict[str, tuple[int, str]] = {}
        # Names a %%local cell bound while attached since the worker last got them: the notebook's
        # value is the newer one, sent again when a cell there reads it and kept at a release.
        self.edited: set[str] = set()

    def ids(self) -> dict[str, int]:
        """Name -> id of each user value, before a ``%%local`` cell (:meth:`local_ran`)."""
        return {name: id(value) for name, value in self.shell.user_ns.items() if not name.startswith("_")}

    def local_ran(self, before: dict[str, int]) -> None:
        """After a ``%%local`` cell while attached: the names it bound anew (``before``: :meth:`ids`)
        are the notebook's own now. A value changed in place keeps its id, and is not seen."""
        hidden = self.shell.user_ns_hidden
        self.edited |= {name for name, value in self.shell.user_ns.items()
                        if not name.startswith("_") and name not in hidden and before.get(name) != id(value)}

    def undefined(self, names: list[str]) -> list[str]:
        """Those of ``names`` not defined in the user's namespace."""
        return [n for n in names if n not in self.shell.user_ns]

    def take(self, values: dict[str, Any], items: list[dict[str, Any]], keep_edited: bool = False) -> list[str]:
        """Put pulled ``values`` into the user's namespace, remembering the
        device of each that came off an accelerator; with ``keep_edited`` (a
        release's bringing back), not those a ``%%local`` cell bound since the
        worker got them (:attr:`edited`), whose names are returned."""
        kept = sorted(name for name in values if name in self.edited) if keep_edited else []
        values = {name: value for name, value in values.items() if name not in kept}
        self.edited -= set(values)
        self.shell.user_ns.update(values)
        for item in items:
            name = item["name"]
            if item.get("device") and name in values:
                self.devices[name] = (id(values[name]), item["device"])
            else:
                self.devices.pop(name, None)
        return kept

    def take_outputs(self, values: dict[str, Any]) -> None:
        """Put the worker's pulled results (``{"_4": value}``) into this kernel's output
        history, ``Out[4]`` and ``_4``, as its own displayhook would have."""
        out = self.shell.history_manager.output_hist  # the user's Out
        for name, value in values.items():
            out[output_count(name)] = value
        self.shell.user_ns.update(values)

    def send(self, attachment: Attachment, names: list[str]):
        """Push local ``names`` with the devices remembered for them (only while
        the local value is still the one that was pulled); returns
        :meth:`Attachment.push`'s ``(items, errors)``."""
        values = {n: self.shell.user_ns[n] for n in names}
        devices = {n: self.devices[n][1] for n in names if n in self.devices and self.devices[n][0] == id(values[n])}
        items, errors = attachment.push(values, devices)
        self.edited -= {item["name"] for item in items}
        return items, errors

    def follow(self, attachment: Attachment, cell: str) -> None:
        """Send along the local names ``cell`` reads that the worker lacks, or
        holds older than a ``%%local`` cell left them (:attr:`edited`), with a
        one-line note; one line per value that cannot be sent."""
        # A name the cell binds is the worker's own value after it (once it has what the cell reads).
        bound = names_bound(cell) if self.edited else set()
        candidates = local_candidates(cell, self.shell.user_ns, self.shell.user_ns_hidden)
        missing = []
        if candidates:
            have = attachment.have(candidates)
            missing = [n for n in candidates if n not in have or n in self.edited]
        self.edited -= bound
        if not missing:
            return
        items, errors = self.send(attachment, missing)
        if items:
            say(f"sent along {describe(items)}")
        for name, why in errors.items():
            print(f"gpupool: could not send {name}: {why}", file=sys.stderr, flush=True)
