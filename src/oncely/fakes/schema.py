"""The one JSON instance of a schema the fake model answers for a prompt
(docs/fakes.md): an enum takes the first of its values, in declared order,
that the message mentions (case-insensitive; the second one for a ``v2``
model), else its first value; strings are the summary fitted to
``minLength``/``maxLength`` (or a fixed value for a known ``format``);
numbers the least their bounds allow (0 without one); booleans false;
objects every property; arrays ``minItems`` items; ``$ref``, ``anyOf``,
``oneOf``, ``allOf`` and ``const`` are followed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Values for string formats pydantic emits, where the summary would not validate.
_STRING_FORMATS = {
    "date-time": "1970-01-01T00:00:00Z",
    "date": "1970-01-01",
    "time": "00:00:00",
    "duration": "PT0S",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "email": "fake@example.com",
    "uri": "https://example.com/",
}


class InvalidSchema(ValueError):
    """A response schema the fake cannot build an instance of (a real provider
    refuses such a request with a 400 too)."""


_Schema = Mapping[str, Any]
_Expanding = frozenset[str]  # the ``$ref``s being filled on the current path


@dataclass(frozen=True)
class SchemaFiller:
    """Builds the one instance of a JSON schema the fake answers for a prompt."""

    root: _Schema
    lowered: str  # the last user message, lower-cased, for enum choices
    summary: str
    second_choice: bool

    def fill(self, schema: _Schema, expanding: _Expanding = frozenset()) -> object:
        if "$ref" in schema:
            return self._fill_ref(schema["$ref"], expanding)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return self._choose(schema["enum"])
        alternatives = schema.get("anyOf") or schema.get("oneOf")
        if alternatives:
            return self.fill(_pick(alternatives, expanding), expanding)
        if "allOf" in schema:
            return _merge([self.fill(part, expanding) for part in schema["allOf"]])
        return self._fill_typed(schema, expanding)

    def _fill_ref(self, ref: str, expanding: _Expanding) -> object:
        if ref in expanding:
            return None  # a model that must contain itself has no finite instance
        return self.fill(_resolve(self.root, ref), expanding | {ref})

    def _choose(self, values: Sequence[object]) -> object:
        """The first value the prompt mentions (v2: the second), else the first value."""
        if not values:
            raise InvalidSchema("an enum without values")
        mentioned = [v for v in values if isinstance(v, str) and v.lower() in self.lowered]
        if not mentioned:
            return values[0]
        return mentioned[1] if self.second_choice and len(mentioned) > 1 else mentioned[0]

    def _fill_typed(self, schema: _Schema, expanding: _Expanding) -> object:
        kind = _type_of(schema)
        if kind == "object":
            properties = schema.get("properties", {})
            return {name: self.fill(prop, expanding) for name, prop in properties.items()}
        if kind == "array":
            return self._fill_array(schema, expanding)
        if kind in ("string", "any"):
            fixed = _STRING_FORMATS.get(schema.get("format", ""))
            return fixed or _fit(self.summary, schema.get("minLength", 0), schema.get("maxLength"))
        if kind in ("integer", "number"):
            return _least_number(schema, integer=kind == "integer")
        if kind in ("boolean", "null"):
            return False if kind == "boolean" else None
        raise InvalidSchema(f"unknown type {kind!r}")

    def _fill_array(self, schema: _Schema, expanding: _Expanding) -> list[object]:
        items = [self.fill(part, expanding) for part in schema.get("prefixItems", ())]
        missing = schema.get("minItems", 0) - len(items)
        if missing > 0:
            each = schema.get("items")
            items += [self.fill(each if isinstance(each, dict) else {}, expanding)] * missing
        return items


def _resolve(root: _Schema, ref: str) -> _Schema:
    """A local reference (``#/$defs/Name``, ``#/definitions/Name``) in ``root``."""
    if not ref.startswith("#"):
        raise InvalidSchema(f"only local $ref is supported, not {ref!r}")
    target: Any = root
    for token in filter(None, ref[1:].split("/")):
        try:
            target = target[token.replace("~1", "/").replace("~0", "~")]
        except (KeyError, TypeError):
            raise InvalidSchema(f"unresolvable $ref {ref!r}") from None
    if not isinstance(target, dict):
        raise InvalidSchema(f"$ref {ref!r} is not a schema")
    return target


def _pick(alternatives: Sequence[_Schema], expanding: _Expanding) -> _Schema:
    """The first non-null alternative, unless it only recurses into a model being
    filled (``next: Node | None``), where null ends the recursion."""
    for alternative in alternatives:
        if alternative.get("type") != "null" and alternative.get("$ref") not in expanding:
            return alternative
    return next((a for a in alternatives if a.get("type") == "null"), alternatives[0])


def _merge(parts: list[object]) -> object:
    """``allOf``: the objects' properties together; otherwise the first part."""
    merged: dict[str, object] = {}
    for part in parts:
        if not isinstance(part, dict):
            return parts[0]
        merged.update(part)
    return merged


def _type_of(schema: _Schema) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        return "object" if "properties" in schema else "any"
    return str(kind)


def _fit(text: str, min_length: int, max_length: int | None) -> str:
    """``text`` repeated up to ``min_length``, cut at ``max_length``."""
    if len(text) < min_length:
        text = " ".join([text] * (min_length // (len(text) + 1) + 1))
    return text if max_length is None else text[:max_length]


def _least_number(schema: _Schema, *, integer: bool) -> float:
    """The minimum (0 without one), kept inside the upper bounds."""
    value: float = schema.get("minimum", 0)
    above = schema.get("exclusiveMinimum")
    if above is not None and ("minimum" not in schema or value <= above):
        value = math.floor(above) + 1 if integer else above + 1
    if "maximum" in schema and value > schema["maximum"]:
        value = schema["maximum"]
    below = schema.get("exclusiveMaximum")
    if below is not None and value >= below:
        lower = schema.get("minimum", above)
        if integer:
            value = math.ceil(below) - 1
        else:
            value = below - 1 if lower is None else (lower + below) / 2
    return math.ceil(value) if integer else value
