"""Typed JSON <-> dataclasses, driven by the dataclasses' type hints.

`parse_value(document, hint, path, source)` checks parsed JSON against a type hint (dataclasses,
lists, 2-tuples, dicts, unions with None, int / float / str / bool) and builds the typed value;
every problem is one `ConfigError` naming the file and the dotted key (`run.json: lengths[0].seq_len
must be an integer, got "4k"`, `run.json: unknown key optimizer.beta1`). `unparse` is the inverse; `parse_json_text` reads the text itself.
A field stored under another JSON key carries it in its metadata (`json_key`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any

from datalines.files import JSONObject
from engine.errors import ConfigError


def json_key(name: str) -> dict[str, str]:
    """Field metadata for a field stored under another key in JSON."""
    return {"json_key": name}


INTERNAL: dict[str, bool] = {"internal": True}
"""Field metadata for a field that is not part of the JSON form."""


def malformed_json(error: json.JSONDecodeError) -> str:
    """`malformed JSON at line L column C: <what>`: the one wording of a JSON syntax error.

    Some of the decoder's messages end in "at" (`Invalid control character at`, `Unterminated string
    starting at`), since Python appends the place to them itself; set after our own "at line L
    column C" they read as cut off, so that dangling tail is dropped."""
    what = error.msg.removesuffix(" at").removesuffix(" starting")
    return f"malformed JSON at line {error.lineno} column {error.colno}: {what}"


def parse_json_text(text: str, source: str) -> Any:
    """`json.loads(text)`, every failure one `ConfigError` naming `source` and where it is."""
    try:
        return json.loads(text, object_pairs_hook=JSONObject.from_pairs)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{source}: {malformed_json(error)}") from None
    except ValueError as error:  # e.g. an integer past Python's 4,300-digit conversion limit
        raise ConfigError(f"{source}: cannot be parsed ({str(error).split(';')[0]})") from None
    except RecursionError:  # the decoder recurses once per level: `[[[[...` thousands deep
        raise ConfigError(f"{source}: cannot be parsed (lists or objects nested too deeply)") from None


def _refuse_repeated(value: Any, path: str, source: str) -> None:
    repeated = getattr(value, "repeated", None)
    if repeated is not None:
        raise ConfigError(f"{source}: key {_join(path, repeated)} appears twice (JSON would keep only the last)")


def json_name(spec: dataclasses.Field[Any]) -> str:
    return spec.metadata.get("json_key", spec.name)


def show(value: Any) -> str:
    """A value as a user would write it in JSON (token counts as `4.7e9`, not `4700000000.0`)."""
    if isinstance(value, float) and math.isfinite(value) and abs(value) >= 1e6:
        mantissa, exponent = f"{value:.14e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


SHOWN_CHARS = 40
"""The longest value an error shows as written; a longer one is named by its type and size (a whole
run.json where an object was wanted would make a one-line error of kilobytes)."""


def show_briefly(value: Any) -> str:
    """`show(value)`, or what kind of JSON value it is when that is longer than SHOWN_CHARS."""
    text = show(value)
    if len(text) <= SHOWN_CHARS:
        return text
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return f"an object of {len(value)} key{'s' if len(value) != 1 else ''}"
    if isinstance(value, str):
        return f"a string of {len(value)} characters starting {show(value[:SHOWN_CHARS])}"
    return f"{text[:SHOWN_CHARS]}..."


def _describe(hint: Any) -> str:
    """What a type hint expects, in words (`an integer`, `a number or null`)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if origin is list:
        return "a list"
    if origin is tuple:
        return f"a list of {len(typing.get_args(hint))} numbers"
    return "an object"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_error(source: str, path: str, hint: Any, value: Any) -> ConfigError:
    return ConfigError(f"{source}: {path} must be {_describe(hint)}, got {show_briefly(value)}")


def parse_value(value: Any, hint: Any, path: str, source: str) -> Any:
    """Check `value` (parsed JSON) against `hint` and build the typed value."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(hint)
        if value is None and type(None) in arms:
            return None
        # The JSON type picks the arm: a list goes to the list arm, a number to the number arm.
        for arm in arms:
            if arm is not type(None) and _json_kind_matches(value, arm):
                return parse_value(value, arm, path, source)
        raise _type_error(source, path, hint, value)
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(source, path, hint, value)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        # 1e6 is a natural way to write a million in JSON; a fractional value is an error.
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        raise _type_error(source, path, hint, value)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{source}: {path} must be a finite number, got {show(value)}")
            return float(value)
        raise _type_error(source, path, hint, value)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _type_error(source, path, hint, value)
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(source, path, hint, value)
        (item_hint,) = typing.get_args(hint)
        return [parse_value(item, item_hint, f"{path}[{index}]", source) for index, item in enumerate(value)]
    if origin is tuple:
        item_hints = typing.get_args(hint)
        if not isinstance(value, list) or len(value) != len(item_hints):
            raise _type_error(source, path, hint, value)
        return tuple(
            parse_value(item, item_hint, f"{path}[{index}]", source)
            for index, (item, item_hint) in enumerate(zip(value, item_hints))
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(source, path, hint, value)
        _refuse_repeated(value, path, source)
        _key_hint, item_hint = typing.get_args(hint)
        return {key: parse_value(item, item_hint, _join(path, key), source) for key, item in value.items()}
    if dataclasses.is_dataclass(hint):
        return _parse_dataclass(value, hint, path, source)
    raise TypeError(f"unsupported type hint {hint!r} at {path}")


def _json_kind_matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the JSON kind a hint expects (used to pick a union's arm)."""
    origin = typing.get_origin(hint)
    if hint in (int, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is bool:
        return isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, list)
    return isinstance(value, dict)


def _parse_dataclass(value: Any, cls: type, path: str, source: str) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {path or 'the top level'} must be an object, got {show_briefly(value)}")
    _refuse_repeated(value, path, source)
    hints = typing.get_type_hints(cls)
    specs = {json_name(spec): spec for spec in _json_fields(cls)}
    for key in sorted(value):
        if key not in specs:
            raise ConfigError(f"{source}: unknown key {_join(path, key)}")
    arguments: dict[str, Any] = {}
    for key, spec in specs.items():
        if key in value:
            arguments[spec.name] = parse_value(value[key], hints[spec.name], _join(path, key), source)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: missing key {_join(path, key)}")
    return cls(**arguments)


def _json_fields(cls_or_instance: Any) -> list[dataclasses.Field[Any]]:
    """The fields stored in JSON (an `internal` field is bookkeeping, never read or written)."""
    return [spec for spec in dataclasses.fields(cls_or_instance) if not spec.metadata.get("internal")]


def unparse(value: Any) -> Any:
    """The JSON form of a typed value (dataclasses as objects under their JSON keys)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = typing.get_type_hints(type(value))
        fields = _json_fields(value)
        return {json_name(spec): _unparse_field(getattr(value, spec.name), hints[spec.name]) for spec in fields}
    if isinstance(value, (list, tuple)):
        return [unparse(item) for item in value]
    if isinstance(value, dict):
        return {key: unparse(item) for key, item in value.items()}
    return value


EXACT_INTEGERS = 2**53
"""Below this magnitude a float holds every integer exactly, so a whole float is written as that integer."""


def _unparse_field(value: Any, hint: Any) -> Any:
    """A field's JSON form. A whole number in a float field (a token count: `"until": 100000`, parsed
    to 100000.0) is written as an integer, as the user wrote it, not as `100000.0` after every load
    and save; parsing makes it a float again, so the value round-trips. A value under `Any`
    (model.overrides) is left as parsed, which is as the user wrote it: a model's float field
    must not become an integer there."""
    whole = isinstance(value, float) and value.is_integer() and abs(value) < EXACT_INTEGERS
    if whole and (hint is float or float in typing.get_args(hint)):
        return int(value)
    return unparse(value)
