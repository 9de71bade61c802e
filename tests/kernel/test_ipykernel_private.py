"""The private ipykernel names gpupool's kernels use (gpupool.ipykernel_private):
all present on the installed ipykernel, and a missing one named in words."""

from __future__ import annotations

import pytest

from gpupool import ipykernel_private
from gpupool.ipykernel_private import NAMES, WORKER_NAMES, IpykernelMismatch, Name, check, missing
from gpupool.kernelapp import WorkerKernelApp
from gpupool.magics.kernelapp import GPUPoolKernelApp


def test_the_installed_ipykernel_has_every_private_name_the_kernels_use():
    lacking = [str(name) for name in missing()]
    assert not lacking, f"the installed ipykernel lacks {', '.join(lacking)} (see gpupool/ipykernel_private.py)"
    check()


def test_a_missing_required_name_stops_the_check_with_its_name():
    gone = Name("ipykernel.kernelbase", "Kernel", "_no_such_private_name")
    with pytest.raises(IpykernelMismatch, match=r"ipykernel\.kernelbase\.Kernel\._no_such_private_name.*"
                                                r"checked against ipykernel 7\.4"):
        check((*NAMES, gone))


def test_a_missing_optional_name_is_reported_but_does_not_stop_the_kernels():
    gone = Name("ipykernel.iostream", "OutStream", "_no_such_buffer", required=False)
    assert missing((*NAMES, gone)) == [gone]
    check((*NAMES, gone))


def test_instance_attributes_count_when_the_class_init_assigns_them():
    assert missing((Name("ipykernel.kernelbase", "Kernel", "shell_handlers"),)) == []


@pytest.mark.parametrize("app, names", [(WorkerKernelApp, WORKER_NAMES), (GPUPoolKernelApp, NAMES)])
def test_each_kernel_application_checks_the_names_its_kernel_uses_at_start(monkeypatch, app, names):
    checked = []

    def refuse(names):
        checked.append(names)
        raise IpykernelMismatch("no")

    monkeypatch.setattr(ipykernel_private, "check", refuse)
    with pytest.raises(IpykernelMismatch):
        app().initialize([])
    assert checked == [names]


def test_a_worker_needs_fewer_names_than_the_gpupool_kernel():
    required = {name.attr for name in WORKER_NAMES if name.required}
    assert required == {"_allow_stdin"} and set(WORKER_NAMES) < set(NAMES)


def test_an_outstream_of_another_layout_always_flushes():
    class Stranger:
        echo = None

    assert ipykernel_private.nothing_pending(Stranger()) is False
