"""Typed reads of JSON into frozen dataclasses: every field checked against its type hint, then its range.

Every artifact (and the bundle manifest) is read through `build`, so a file that parses as JSON
but holds the wrong shape (a list where an object belongs, a string where a size belongs, an
expert of -1) is refused at the door in one sentence naming the field, instead of failing later
as a traceback deep inside a stage.

    build(LayerCheck, {"layer": 0, "routing_agreement": 1.0, "max_abs_diff": 0.0})   # -> LayerCheck
    build(tuple[int, ...], [1, "x"])   # SchemaError: [1] must be an integer, not the string 'x'

Type hints understood: int, float, str, bool, None, Any, list[X], tuple[X, ...], tuple[X, Y],
dict[K, V], X | None (and other unions), and nested dataclasses. A dataclass may define
`validate(self)` for what its types cannot say (an offset inside its shard, bits among the
stored precisions); it raises `SchemaError(field, problem)` with the field relative to itself.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import re
import types
import typing
from typing import Any

# Sizes, counts, indices and durations are never negative, in whichever artifact they appear: a
# field named like one is checked here once, instead of in a `validate` of every dataclass.
NEVER_NEGATIVE = re.compile(r"^(n|nbytes|offset|layer|expert|tokens|steps|top_k|hot_k|crc32|num_\w+)$"
                            r"|_bytes$|^bytes_|_s$")
# Shares (a hit rate, the share of tokens the top experts take, an agreement) lie in [0, 1].
SHARE = re.compile(r"(^|_)(rate|share|agreement)$")
CRC32_END = 1 << 32


class SchemaError(ValueError):
    """A value that does not fit its schema. `field` is its path from the top ("entries[3].expert")."""

    def __init__(self, field: str, problem: str, missing: bool = False):
        self.field, self.problem, self.missing = field, problem, missing
        super().__init__(self.sentence())

    def sentence(self) -> str:
        if self.missing:
            return f"missing {self.field}"
        return f"{self.field} {self.problem}" if self.field else self.problem

    def under(self, prefix: str) -> SchemaError:
        """The same error, its field seen from the dataclass that holds `prefix`."""
        if not prefix:
            return self
        if self.missing:
            return SchemaError(", ".join(_join(prefix, f) for f in self.field.split(", ")), self.problem, True)
        return SchemaError(_join(prefix, self.field), self.problem)


def build(tp: Any, value: Any, path: str = "") -> Any:
    """Rebuild a value of type `tp` from its JSON form, or raise SchemaError naming the bad field."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, path)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(args, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise SchemaError(path, f"must be a list, not {describe(value)}")
        if origin is list:
            # a Run's token ids, a few thousand a prompt: one pass where every element is already what it
            # must be (35 us a token had gone to building each one's path); the element-wise read below
            # names the first that is not, and takes 3.0 for 3
            if args[0] in (int, str) and all(type(v) is args[0] for v in value):
                return list(value)
            return [build(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(build(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise SchemaError(path, f"must be a list of {len(args)} values, not {len(value)}")
        return tuple(build(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(path, f"must be an object, not {describe(value)}")
        ktype, vtype = args
        if ktype is str and vtype in (int, float, str) and all(type(k) is str and type(v) is vtype
                                                              for k, v in value.items()):
            return dict(value)  # an entry's errors per projection: each already what it must be
        out = {}
        for k, v in value.items():
            if ktype is str and not isinstance(k, str):
                raise SchemaError(path, f"must have string keys, not {describe(k)}")
            if ktype is int:  # precisions: integers in memory, JSON object keys (strings) on disk
                if isinstance(k, str) and re.fullmatch(r"-?[0-9]+", k):
                    k = int(k)
                elif not isinstance(k, int) or isinstance(k, bool):
                    raise SchemaError(path, f"must have integer keys, not {describe(k)}")
            out[k] = build(vtype, v, f"{path}[{_short(k)}]")
        return out
    return _scalar(tp, value, path)


def build_fields(tp: type, value: Any, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of dataclass `tp` that `value` holds, each checked as `build` checks it; only the
    names in `required` must be there. For records read leniently (report takes hand-made evals)."""
    if not isinstance(value, dict):
        raise SchemaError("", f"must be an object, not {describe(value)}")
    missing = [name for name in required if name not in value]
    if missing:
        raise SchemaError(", ".join(missing), "", missing=True)
    return {name: _range(name, build(hint, value[name], name), name)
            for name, hint, _ in _fields(tp) if name in value}


def describe(value: Any) -> str:
    """A short name of a JSON value for an error message (never more than one line)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Number):
        return f"the number {_short(value)}"
    if isinstance(value, str):
        return f"the string {_short(value)}"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)  # repr escapes newlines: a message stays one line
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _join(prefix: str, name: str) -> str:
    if not prefix:
        return name
    return f"{prefix}{name}" if name.startswith("[") else f"{prefix}.{name}"


@functools.cache
def _fields(tp: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type hint, required) of each init field of a dataclass, resolved once per class."""
    hints = typing.get_type_hints(tp)
    return tuple((f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(tp) if f.init)


@functools.cache
def _plan(tp: type) -> tuple[tuple[str, Any, type | None, bool, bool], ...]:
    """Per init field of a dataclass: its name, hint, the plain type (int, float, str, bool) a value of
    it may have to be taken without `build` (None: any other hint), whether None is also taken, and
    whether `_range` has a rule for its name (only a non-negative integer passes that rule unread)."""
    out = []
    for name, hint, _ in _fields(tp):
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
        none_ok = type(None) in args and len(args) == 2
        plain = next((a for a in args if a is not type(None)), None) if none_ok else hint
        plain = plain if plain in (int, float, str, bool) else None
        ranged = bool(SHARE.search(name) or NEVER_NEGATIVE.search(name))
        if ranged and plain is not int:  # a share, a float size or duration: read through `_range`
            plain = None
        out.append((name, hint, plain, none_ok, ranged))
    return tuple(out)


def _dataclass(tp: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise SchemaError(path, f"must be an object, not {describe(value)}")
    fields = _fields(tp)
    missing = [name for name, _, required in fields if required and name not in value]
    if missing:
        raise SchemaError(", ".join(_join(path, m) for m in missing), "", missing=True)
    kwargs = {}
    for name, hint, plain, none_ok, ranged in _plan(tp):
        if name in value:
            v = value[name]
            # A bundle's manifest holds a few entries per expert (59,392 at DeepSeek-V3's 58 x 256 x 4
            # precisions, 8 s to read each field through `build`): a value already of its field's plain
            # type, within the field's range rule, is taken as it is; anything else goes through `build`,
            # which names what is wrong.
            if v is None and none_ok or plain is not None and type(v) is plain and (plain is not int or (
                    -INT_END < v < INT_END and (not ranged or 0 <= v and (name != "crc32" or v < CRC32_END)))):
                kwargs[name] = v
                continue
            where = _join(path, name)
            kwargs[name] = _range(name, build(hint, v, where), where)
    obj = tp(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except SchemaError as e:
            raise e.under(path) from None
    return obj


def _range(name: str, value: Any, path: str) -> Any:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and abs(value) >= INT_END:  # no float holds it: arithmetic overflowed
        raise SchemaError(path, f"is an integer of {len(str(abs(value)))} digits; nothing an artifact records "
                                "is beyond 64 bits")
    if SHARE.search(name) and not 0.0 <= value <= 1.0:  # NaN fails this too
        raise SchemaError(path, f"is {_short(value)}; a share must lie in [0, 1]")
    if NEVER_NEGATIVE.search(name):
        if value != value:  # NaN: a size, count or duration that was never measured is null, not NaN
            raise SchemaError(path, "is NaN; it must be a number")
        if value < 0:
            raise SchemaError(path, f"is {_short(value)}; it must not be negative")
        if name == "crc32" and value >= CRC32_END:
            raise SchemaError(path, f"is {_short(value)}, not a CRC-32 (below 2**32)")
    return value


INT_END = 2**64  # sizes, counts, seeds and digests: every integer an artifact records is below it


def check_named_number(name: str, value: Any, path: str) -> Any:
    """`_range`'s rules for a number in a free-form object (an engine counter named like a field)."""
    return _range(name, value, path)


def _union(args: tuple[Any, ...], value: Any, path: str) -> Any:
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:
        try:
            return build(options[0], value, path)
        except SchemaError as e:
            if e.field != path or e.missing or type(None) not in args:
                raise
            raise SchemaError(path, e.problem.replace(" must be ", " must be null or ", 1)
                              if e.problem.startswith("must be ") else e.problem) from None
    for option in options:
        try:
            return build(option, value, path)
        except SchemaError:
            continue
    names = " or ".join(_expected(a) for a in args)
    raise SchemaError(path, f"must be {names}, not {describe(value)}")


def _expected(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return "an object"
    if typing.get_origin(tp) in (list, tuple):
        return "a list"
    return _SCALARS.get(tp, (None, getattr(tp, "__name__", str(tp))))[1]


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


_SCALARS: dict[Any, tuple[Any, str]] = {
    int: (_is_int, "an integer"),
    float: (_is_real, "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    type(None): (lambda v: v is None, "null"),
}


def _scalar(tp: Any, value: Any, path: str) -> Any:
    check, name = _SCALARS.get(tp, (None, None))
    if check is None:  # a plain class the table does not know: its instances only
        if isinstance(tp, type) and isinstance(value, tp):
            return value
        raise SchemaError(path, f"must be a {getattr(tp, '__name__', tp)}, not {describe(value)}")
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 3.0 from a hand-edited file: the same count
    if not check(value):
        raise SchemaError(path, f"must be {name}, not {describe(value)}")
    return int(value) if tp is int else value


__all__ = ["NEVER_NEGATIVE", "SchemaError", "build", "build_fields", "check_named_number", "describe"]
