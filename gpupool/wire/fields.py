"""One declaration per wire field: its JSON Schema and its plain checks.

A body is a dataclass (a :class:`Body`) whose fields are made by :func:`wired`,
which puts a :class:`Spec` in the field's metadata. So each field's name,
Python default, JSON type, limits and words are written once, and from them

- ``Body.json_schema()`` gives the body's JSON Schema (the OpenAPI document's
  ``components.schemas`` are made of these), and
- ``Body.read(body)`` does the checks of one field at a time (type, null,
  limits, length, pattern, choices), raising a 400 GPUPoolError with the
  field's words, or reading a bad value as None where the field is lenient.

Rules between fields (several GPUs are whole GPUs; host cores and memory go
together) stay as code in the body's ``from_json``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, ClassVar

from ..errors import GPUPoolError, bad_request
from ..schema import has_control_characters, is_unicode, number_field

#: Where a body's schema is found in the OpenAPI document (``$ref`` targets).
REF = "#/components/schemas/"
#: Text without ASCII control characters (:func:`gpupool.schema.has_control_characters`).
TEXT = "[^\\x00-\\x1f\\x7f]"
#: ... that is not white space either (``str.strip`` would remove it).
INK = "[^\\s\\x00-\\x1f\\x7f]"
#: Words of at least one visible character, one line (``value.strip()`` is not empty).
WORDS = f"^{TEXT}*{INK}{TEXT}*$"
_META = "gpupool.wire"
_UNSET = object()
_DEFAULT_ERRORS = {
    "enum": "'{key}' must be one of {choices}, got {value!r:.80}",
    "boolean": "'{key}' must be true or false, got {value!r:.80}",
    "text": "'{key}' must be a non-empty string of at most {max_length} characters, without control characters",
}


def ref(name: str) -> dict[str, str]:
    """A JSON Schema reference to the component ``name``."""
    return {"$ref": f"{REF}{name}"}


@dataclasses.dataclass(frozen=True)
class Spec:  # pylint: disable=too-many-instance-attributes  # one attribute per JSON Schema keyword
    """One field on the wire.

    ``type``: the JSON type (``"number"``, ``"integer"``, ``"string"``,
    ``"boolean"``, ``"array"``, ``"object"``; ``""`` with ``enum``: any of its
    values). ``nullable``: null is allowed (read as None); ``required``: the
    key must be there. ``text``: a one-line string that every store can keep
    (no control characters, no lone surrogate). ``items``: the schema of an
    array's items, or the :class:`Body` they are. ``extra``: other keywords, as
    they are. ``error``: the words of the 400 (``{key}``, ``{value}``,
    ``{choices}``, ``{max_length}`` and the reader's context are filled in),
    or a function of the value giving them; ``missing``: the words when a
    required field is absent or null (default: "'{key}' is required" for a
    loose number, else ``error``). ``loose``: a number is read with
    :func:`~gpupool.schema.number_field` (its words for what is not a finite
    number); else any non-number is ``error`` too. Either way an integer must
    be a JSON integer: a float (``1.5e9``, ``2.0``) is refused with
    ``error``, never taken as the whole number it rounds to. ``lenient``: a bad value is
    read as None instead of refused, and its schema names no bounds (a value
    beyond them is not refused).
    """

    type: str
    description: str | None = None
    nullable: bool = False
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    max_items: int | None = None
    pattern: str | None = None
    text: bool = False
    enum: tuple[Any, ...] | None = None
    default: Any = _UNSET
    format: str | None = None
    items: Any = None
    extra: dict[str, Any] | None = None
    error: str | Callable[[Any], str] | None = None
    missing: str | None = None
    loose: bool = True
    lenient: bool = False

    def schema(self) -> dict[str, Any]:
        """The field's JSON Schema (2020-12, as OpenAPI 3.1 uses it)."""
        out: dict[str, Any] = {}
        if self.type:
            out["type"] = [self.type, "null"] if self.nullable else self.type
        if self.enum is not None:
            out["enum"] = [*self.enum, None] if self.nullable and self.type else list(self.enum)
        bounds = {"minimum": self.minimum, "maximum": self.maximum, "exclusiveMinimum": self.exclusive_minimum,
                  "minLength": self.min_length, "maxLength": self.max_length, "maxItems": self.max_items,
                  "pattern": self.pattern or (f"^{TEXT}{'+' if self.min_length else '*'}$" if self.text else None)}
        keywords = {"format": self.format, "items": _items(self.items), "description": self.description}
        out.update((k, v) for k, v in ({} if self.lenient else bounds).items() if v is not None)
        out.update((k, v) for k, v in keywords.items() if v is not None)
        if self.default is not _UNSET:
            out["default"] = self.default
        return out | (self.extra or {})

    def read(self, body: dict[str, Any], key: str, context: dict[str, Any] | None = None) -> Any:
        """``body[key]`` checked: None when absent (or null and nullable); a
        number as a float (an integer as an int); 400 with :attr:`error`
        (``context`` filled in) otherwise (None where :attr:`lenient`)."""
        value = body.get(key)
        if value is None and self.required:
            words = self.missing or ("'{key}' is required" if self.loose and _numeric(self.type) else None)
            raise bad_request(words.format(key=key)) if words else self._refusal(key, None, context)
        if value is None and (key not in body or self.nullable):
            return None
        try:
            return self._checked(key, value, context)
        except GPUPoolError:
            if self.lenient:
                return None
            raise

    def _checked(self, key: str, value: Any, context: dict[str, Any] | None) -> Any:
        if _numeric(self.type):
            return self._number(key, value, context)
        if not _of_type(self.type, value) or not self._fits(value):
            raise self._refusal(key, value, context)
        return value

    def _number(self, key: str, value: Any, context: dict[str, Any] | None) -> float | int:
        # JSON Schema's integer is a number with no fractional part: 2.0 and 1.5e9 are integers, 1.5 is not.
        if self.loose:
            number: Any = number_field({key: value}, key, required=True)  # its words for a non-number
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._refusal(key, value, context)
        else:
            number = value
        if not self._in_range(number):
            raise self._refusal(key, value, context)
        if self.type == "integer":
            return value if isinstance(value, int) else int(value)  # an int as sent: 2**53 + 1 stays exact
        return number

    def _in_range(self, number: float) -> bool:
        # ``not a < b`` rather than ``a >= b``: NaN (a strict field's float) fails every bound.
        return not ((self.minimum is not None and not number >= self.minimum)
                    or (self.maximum is not None and not number <= self.maximum)
                    or (self.exclusive_minimum is not None and not number > self.exclusive_minimum)
                    # A float must be whole (inf and NaN are not); an int is (10**400 too, too large for a float).
                    or (self.type == "integer" and isinstance(number, float) and not number.is_integer()))

    def _fits(self, value: Any) -> bool:
        if self.enum is not None and value not in self.enum:
            return False
        if isinstance(value, list):
            return self.max_items is None or len(value) <= self.max_items
        if not isinstance(value, str):
            return True
        return not ((self.min_length is not None and len(value) < self.min_length)
                    or (self.max_length is not None and len(value) > self.max_length)
                    or (self.pattern is not None and not re.fullmatch(self.pattern, value))
                    or (self.text and (has_control_characters(value) or not is_unicode(value))))

    def _refusal(self, key: str, value: Any, context: dict[str, Any] | None = None) -> GPUPoolError:
        if callable(self.error):
            return bad_request(self.error(value))
        kind = "enum" if self.enum is not None else "text" if self.text else self.type
        words = self.error or _DEFAULT_ERRORS.get(kind, "'{key}' must be of type {kind}, got {value!r:.80}")
        choices = ", ".join(map(str, self.enum or ()))
        return bad_request(words.format(key=key, value=value, choices=choices, max_length=self.max_length, kind=kind,
                                        **(context or {})))


def _numeric(json_type: str) -> bool:
    return json_type in ("number", "integer")


def _of_type(json_type: str, value: Any) -> bool:
    """Whether ``value`` (not a number) is of ``json_type`` ("" : any)."""
    kinds: dict[str, Any] = {"string": str, "boolean": bool, "array": list, "object": dict}
    return not json_type or isinstance(value, kinds[json_type])


def _items(items: Any) -> dict[str, Any] | None:
    if isinstance(items, type) and issubclass(items, Body):
        return ref(items.__name__)
    return items


def wired(spec: Spec, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field on the wire, described by ``spec``; ``default`` (or
    ``factory``) as :func:`dataclasses.field` takes them."""
    return dataclasses.field(default=default, default_factory=factory, metadata={_META: spec})


class _Keys:
    """``Body.KEYS``: the names of the body's wired fields, in their order."""

    def __get__(self, instance: Any, owner: type) -> tuple[str, ...]:
        return tuple(owner.specs())


class Body:
    """A body on the wire: a dataclass whose fields are made by :func:`wired`.

    ``SCHEMA``: the object's keywords besides its properties (``description``,
    ``additionalProperties``, ``if``/``then``); ``EXTRA``: properties on the
    wire that the reader does not keep as fields (documented only).
    """

    KEYS = _Keys()
    SCHEMA: ClassVar[dict[str, Any]] = {}
    EXTRA: ClassVar[dict[str, Spec]] = {}

    @classmethod
    def specs(cls) -> dict[str, Spec]:
        """Field name -> its :class:`Spec`, in declaration order."""
        return {f.name: f.metadata[_META] for f in dataclasses.fields(cls) if _META in f.metadata}  # type: ignore[arg-type]

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The body's JSON Schema: an object of its fields and :attr:`EXTRA`."""
        specs = cls.specs() | cls.EXTRA
        schema: dict[str, Any] = {"type": "object", **cls.SCHEMA}
        required = [key for key, spec in specs.items() if spec.required]
        if required:
            schema["required"] = required
        schema["properties"] = {key: spec.schema() for key, spec in specs.items()}
        return schema

    @classmethod
    def read(cls, body: dict[str, Any], *keys: str, **context: Any) -> dict[str, Any]:
        """``{key: Spec.read(body, key)}`` for ``keys`` (default: every field),
        in that order: the first bad one raises its 400, its words filled in
        with ``context`` (e.g. the GPU's ``uuid``)."""
        specs = cls.specs()
        return {key: specs[key].read(body, key, context) for key in keys or specs}
