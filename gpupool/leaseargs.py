"""The options of a lease request that ``%gpu acquire`` and ``gpupool run``
share, declared once, and the :class:`LeaseRequest` they ask for.

    %gpu acquire 0.5 --memory 20GiB --model A100 --wait 10m
    gpupool run --gpus 0.5 --memory 20GiB --model A100 --wait 10m train.py
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

from .errors import GPUPoolError
from .schema import MAX_GPU_COUNT, MIN_FRACTION
from .units import parse_bytes, parse_duration, parse_gpu_amount
from .wire.leases import LeaseRequest

#: ``(flags, add_argument keywords)`` of each shared option, in the order a help lists them.
REQUEST_OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--memory",), {"help": "GPU memory for the slice, e.g. 20GiB (default: the fraction's share)"}),
    (("--model",), {"help": "only GPUs whose name contains this, e.g. A100"}),
    (("--cpus",), {"type": float, "help": "host CPU cores for the worker, e.g. 4 (default: the GPU share's part)"}),
    (("--host-memory",), {"help": "host RAM for the worker, e.g. 32GiB (default: the GPU share's part)"}),
    (("--wait",), {"help": "when no GPU is free, wait in the queue this long, e.g. 10m (default, or 0: refuse at "
                            "once)"}),
    (("--preemptible",), {"action": "store_true",
                          "help": "while others wait, the lease may be parked (after a notice): its running cell or "
                                  "script frozen where it is and resumed later with everything kept (interrupted "
                                  "instead where the node cannot freeze it mid-cell)"}),
)


#: The request's field each option of ``%gpu acquire`` and ``gpupool run`` sets -> the option as a
#: person types it: the words of an error about the field name the option (``--host-memory``, not
#: ``'host_memory'``). The one place those names are mapped.
FIELD_OPTIONS = {"memory": "--memory", "model": "--model", "cpus": "--cpus", "host_memory": "--host-memory",
                 "wait": "--wait", "preemptible": "--preemptible", "idle_timeout": "--idle-timeout", "env": "--env",
                 "on_idle": "--on-idle", "lease_class": "--class"}

#: The options above that take a value (the flags whose value may look like an option: ``-5GiB``).
VALUE_OPTIONS = frozenset(flags[0] for flags, keywords in REQUEST_OPTIONS if keywords.get("action") != "store_true")


def join_negative_values(argv: Sequence[str], options: Iterable[str], *, stop_at_positional: bool = False
                         ) -> list[str]:
    """``argv`` with ``--wait -1m`` written ``--wait=-1m`` for the value-taking ``options``:
    argparse reads a value that starts with ``-`` (and is not a plain negative number) as
    another option, and says ``expected one argument`` instead of what is wrong with the value.
    ``stop_at_positional``: leave everything from the first positional on as it is (a script's
    own arguments)."""
    options, out, i = set(options), [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or (stop_at_positional and not token.startswith("-")):
            return out + list(argv[i:])
        if token in options and i + 1 < len(argv):  # an option and its value
            value = argv[i + 1]
            negative = value[:1] == "-" and (value[1:2].isdigit() or value[1:2] == ".")
            out += [f"{token}={value}"] if negative else [token, value]
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def add_request_options(add: Callable[..., Any]) -> None:
    """Call ``add(*flags, **keywords)`` for each of :data:`REQUEST_OPTIONS`
    (``parser.add_argument``)."""
    for flags, keywords in REQUEST_OPTIONS:
        add(*flags, **keywords)


def lease_request(args: Any, **fields: Any) -> LeaseRequest:
    """The request that parsed options ``args`` ask for: ``args.amount`` (``0.5``,
    ``2``) and the :data:`REQUEST_OPTIONS` (human units: ``20GiB``, ``10m``),
    plus ``args.env`` and ``args.idle_timeout`` where present; ``fields`` set
    the rest (``lease_class``, ``kernel_id``, ``prefer_env``, ...).

    Raises ValueError with words for the user: a bad amount, size or
    duration, ``--cpus`` not above 0, or any value the service would refuse
    (its words, naming the option rather than the request's field), but for a
    count above ``MAX_GPU_COUNT``: the service answers that one with its pool's
    biggest node.
    """
    fraction, count = parse_gpu_amount(args.amount)
    if fraction < MIN_FRACTION:
        raise ValueError(f"a slice is at least {MIN_FRACTION} of a GPU (the smallest CUDA MPS share), "
                         f"got {args.amount}")
    if args.cpus is not None and not args.cpus > 0:
        raise ValueError(f"--cpus must be more than 0 cores, got {args.cpus:g}")
    idle_timeout = getattr(args, "idle_timeout", None)
    # A count above the wire's bound goes to the service all the same: it says what its biggest
    # node has, and so what to ask for (the bound's words only where its nodes are bigger).
    request = checked(LeaseRequest(
        fraction=fraction, gpu_count=min(count, MAX_GPU_COUNT), memory=_read("memory", parse_bytes, args.memory),
        model=args.model, idle_timeout=_read("idle_timeout", parse_duration, idle_timeout),
        wait=_read("wait", lambda text: parse_duration(text, allow_zero=True) or None, args.wait),
        env=getattr(args, "env", None), preemptible=args.preemptible or None, cpus=args.cpus,
        host_memory=_read("host_memory", parse_bytes, args.host_memory), **fields))
    return replace(request, gpu_count=count)


def _read(field: str, parse: Callable[[str], Any], text: str | None) -> Any:
    """``parse(text)`` (None for no text), its ValueError's words led by the option
    the person typed: ``--host-memory: cannot read 'lots' as a memory size; ...``."""
    if not text:
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{FIELD_OPTIONS[field]}: {exc}") from None


def option_words(exc: GPUPoolError) -> GPUPoolError:
    """``exc``, the service's refusal of a request (``POST /leases``), in the words of
    ``%gpu acquire`` and ``gpupool run``: where it starts with the request's field it is
    about (its ``field``), that field is written as the option the person typed
    (``idle_timeout 99h is above your maximum of 24h`` -> ``--idle-timeout 99h ...``);
    the service words it for REST callers, who send the field. Else ``exc`` itself."""
    field = exc.extra.get("field")
    option = FIELD_OPTIONS.get(field) if isinstance(field, str) else None
    if option is None or not exc.message.startswith(f"{field} "):
        return exc
    return GPUPoolError(exc.code, option + exc.message[len(field):], exc.status, log_message=exc.log_message,
                        **exc.extra)


def checked(request: LeaseRequest) -> LeaseRequest:
    """``request`` once it passed the check the service makes of it
    (:meth:`LeaseRequest.from_json`); ValueError with the service's words,
    each field an option sets named as that option (``--host-memory``)."""
    try:
        LeaseRequest.from_json(request.to_json())
    except GPUPoolError as exc:
        words = exc.message
        for field, option in FIELD_OPTIONS.items():
            words = words.replace(f"'{field}'", option)
        raise ValueError(words) from None
    return request
