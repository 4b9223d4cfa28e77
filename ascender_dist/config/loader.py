"""Strict YAML -> typed dataclass loading.

Why not plain ``yaml.safe_load`` + ``Cls(**d)``: PyYAML reads ``1e-3`` as a *string* (YAML 1.1
wants a dot in floats), an unknown key is silently accepted by ``**d`` only to fail somewhere deep,
and a wrong type is discovered steps into a run. Here every key is checked against the dataclass
fields, every value against the annotated type, and every error is one line naming the dotted path.
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
import stat
import types
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from ascender_dist.config.errors import ConfigError

def _shown(value: Any) -> str:
    """``repr(value)`` for an error message, bounded: a few items and levels of a container, the ends
    of a long string (a value built from YAML aliases can expand to gigabytes)."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxstring, shown.maxother = 2, 160, 160
    shown.maxlist = shown.maxtuple = shown.maxdict = shown.maxset = 8
    return shown.repr(value)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 numbers and booleans (below) and plain-name mapping keys."""

    def construct_mapping(self, node, deep=False):
        self.flatten_mapping(node)  # YAML merge keys (<<: *base), as SafeLoader's mapping constructor does
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                raise ConfigError(f"line {key_node.start_mark.line + 1}",
                                  f"mapping keys must be plain names, got a {key_node.id} as a key")
        return super().construct_mapping(node, deep=deep)


# Numbers as YAML 1.2 reads them: 1e-3 and 3E5 are floats (YAML 1.1 wants a dot), and none of
# YAML 1.1's other integer forms, which read 010 as 8 and 1:30 as 90, is a number; such a value
# stays a string and the typed loading names the field that expected a number. An underscore may
# only separate two digits (1_000): 30_ or 1__0 is a typo, kept as a string, not read as 30 or 10.
# YAML 1.1's dates (2024-02-30 is a ValueError inside PyYAML) are not read either: no field is a
# date, and such a value stays a string.
_YAML11_ONLY = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
                "tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:value")  # value: a bare `=`, a string in 1.2
_DIGITS = r"[0-9](?:_?[0-9])*"  # ASCII digits (\d takes any script's), an underscore only between two
_STRICT_NUMBERS = (
    ("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9](?:_?[0-9])*)$"), list("-+0123456789")),
    ("tag:yaml.org,2002:float",
     re.compile(rf"^(?:[-+]?(?:{_DIGITS}\.(?:{_DIGITS})?(?:[eE][-+]?[0-9]+)?|{_DIGITS}[eE][-+]?[0-9]+"
                rf"|\.{_DIGITS}(?:[eE][-+]?[0-9]+)?)"
                r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
     list("-+0123456789.")),
)
# Booleans as YAML 1.2 reads them: only true and false (any of three spellings). YAML 1.1 would also
# read yes/no/on/off as booleans (`name: no` a bool, a grid variant named `off` the string 'False');
# here they stay strings, and a bool field refuses them with its dotted name.
_STRICT_BOOLS = (
    ("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")),
)
# `<<` is a merge only as a mapping key (flatten_mapping reads the key's tag); as a value it is the
# string, as in YAML 1.2, so the typed loading names the field instead of PyYAML naming a tag.
_StrictLoader.add_constructor("tag:yaml.org,2002:merge", yaml.SafeLoader.construct_scalar)
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML11_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _regexp, _first in _STRICT_NUMBERS + _STRICT_BOOLS:
    _StrictLoader.add_implicit_resolver(_tag, _regexp, _first)


class _StrictDumper(yaml.SafeDumper):
    """SafeDumper that also quotes the strings this loader would read as numbers ('3e-4': YAML 1.1
    writes it bare, since to YAML 1.1 it is no number), so every config the project writes reads
    back as it was."""


_StrictDumper.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeDumper.yaml_implicit_resolvers.items()}
for _tag, _regexp, _first in _STRICT_NUMBERS:
    _StrictDumper.add_implicit_resolver(_tag, _regexp, _first)


def dump_yaml(data: Any) -> str:
    """YAML text of a config dict (keys in order) that :func:`parse_yaml_text` reads back unchanged."""
    return yaml.dump(data, Dumper=_StrictDumper, sort_keys=False)


def _reject_duplicate_keys(node, path: str = "", open_nodes: set | None = None, done: set | None = None) -> None:
    """ConfigError naming the dotted path of the first key that a mapping repeats, or of an alias
    that contains itself. Each node is checked once, however many aliases name it (a file of nested
    aliases would otherwise take exponential time)."""
    open_nodes = set() if open_nodes is None else open_nodes  # nodes on the path from the root
    done = set() if done is None else done
    if id(node) in open_nodes:
        raise ConfigError(path or "<root>", f"recursive alias (line {node.start_mark.line + 1})")
    if id(node) in done or not isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        return
    open_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{path}.{key}" if path else str(key)
            if key is not None and key in seen and key != "<<":
                raise ConfigError(dotted, f"duplicate key (line {key_node.start_mark.line + 1})")
            seen.add(key)
            _reject_duplicate_keys(value_node, dotted, open_nodes, done)
    else:
        for i, item in enumerate(node.value):
            _reject_duplicate_keys(item, f"{path}[{i}]", open_nodes, done)
    open_nodes.discard(id(node))
    done.add(id(node))


def parse_yaml_text(text: str, source: str = "<string>") -> Any:
    """The YAML document of ``text`` (None when it holds none); any problem is a one-line ConfigError
    naming ``source``."""
    loader = None
    try:
        loader = _StrictLoader(text)  # its reader refuses control characters here (a ReaderError)
        node = loader.get_single_node()
        if node is None:
            return None
        _reject_duplicate_keys(node)
        return loader.construct_document(node)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc.path}", exc.message) from None
    except yaml.reader.ReaderError as exc:  # a byte YAML forbids: ESC of pasted terminal colours, NUL, ...
        line = text.count("\n", 0, exc.position) + 1 if isinstance(exc.position, int) else None
        where = f" line {line}" if line else ""
        char = chr(exc.character) if isinstance(exc.character, int) else exc.character
        raise ConfigError(source, f"invalid YAML{where}: the character {char!r} is not allowed") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(source, f"invalid YAML{where}: {problem}") from None
    except (ValueError, TypeError, AttributeError) as exc:  # an explicit tag PyYAML cannot build: !!int abc
        raise ConfigError(source, f"invalid YAML value ({type(exc).__name__}: {exc})") from None
    except RecursionError:  # PyYAML composes and builds nodes recursively: [[[[...]]]] thousands deep
        raise ConfigError(source, "invalid YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml_file(path: str | Path) -> dict:
    """The top-level mapping of a YAML config file. A file without a document (empty, only comments,
    or ``null``) is refused: running the defaults because a file was truncated or the wrong one was
    named is a silently wrong run; a config that wants every default says so with ``{}``."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(str(path), "config file not found") from None
    except OSError as exc:  # a folder on the way this user may not enter, a name too long, a loop
        raise ConfigError(str(path), f"cannot read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(str(path), "is a directory, not a config file")
    if not stat.S_ISREG(mode):  # a FIFO, a device such as /dev/null, a socket: no config file to read
        raise ConfigError(str(path), "not a regular file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not a UTF-8 text file (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read ({exc.strerror or exc})") from None
    data = parse_yaml_text(text, source=str(path))
    if data is None:
        raise ConfigError(str(path), "empty config file (write {} to run with every default)")
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"top level must be a mapping, got {type(data).__name__}")
    return data


def _type_name(tp) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        (inner,) = get_args(tp) or (Any,)
        return f"list[{_type_name(inner)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32


class _OutOfRange(ConfigError):
    """A value of the field's type that no such field may hold (reported as such inside an Optional)."""


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` as an instance of annotated type ``tp`` or raise ConfigError naming ``path``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except _OutOfRange:
                raise  # the right type, a value no field of it may hold: that, not "expected str | null"
            except ConfigError:
                pass
        raise ConfigError(path, f"expected {_type_name(tp)}, got {_shown(value)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(path, f"expected one of {_type_name(tp)}, got {_shown(value)}")
        return value
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {type(value).__name__} {_shown(value)}")
        return [_coerce(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
        _, val_tp = get_args(tp) or (Any, Any)
        return {k: _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected bool (true/false), got {_shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected int, got {type(value).__name__} {_shown(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected float, got {type(value).__name__} {_shown(value)}")
        try:
            value = float(value)
        except OverflowError:  # an int beyond float's range
            raise ConfigError(path, f"must be a finite number (got an integer of {len(str(value))} digits)") from None
        if not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number (got {value})")
        if abs(value) > FLOAT32_MAX:  # every float field reaches a float32 / bf16 tensor or computation
            raise _OutOfRange(path, f"must be within float32's range, |x| <= 3.4e38 (got {value})")
        if 0 < abs(value) < FLOAT32_TINY:  # 0 or a denormal in float32: an eps or temperature of 0 underneath
            raise _OutOfRange(path, f"must be 0 or of magnitude >= 1.2e-38 (float32's smallest normal; got {value})")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected str, got {type(value).__name__} {_shown(value)}")
        if "\0" in value:  # no name or path may hold one (the OS refuses it, deep inside a library)
            raise _OutOfRange(path, f"must not contain a NUL character (got {_shown(value)})")
        return value
    raise ConfigError(path, f"unsupported field type {tp!r}")


def leaf_paths(tree: dict, prefix: str = "") -> set[str]:
    """Dotted names of the non-mapping values of a nested mapping (``{"a": {"b": 1}}`` -> ``{"a.b"}``)."""
    return set(iter_leaf_paths(tree, prefix))


def iter_leaf_paths(tree: dict, prefix: str = ""):
    """leaf_paths one at a time, in the mapping's order: a check that stops at its first bad name
    never lists the rest (YAML aliases can make them exponentially many)."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from iter_leaf_paths(value, f"{name}.")
        else:
            yield name


def closest_name(key: str, names) -> str | None:
    """The name ``key`` most likely misspells: the same up to case and underscores, else difflib's
    closest (``hiden_size`` -> ``hidden_size``); None when nothing is close."""
    import difflib

    names = list(names)
    squashed = str(key).lower().replace("_", "")
    same = [name for name in names if name.lower().replace("_", "") == squashed]
    close = same or difflib.get_close_matches(str(key), names, n=1)
    return close[0] if close else None


def _unknown_key_hint(key, fields) -> str:
    """What to say after "unknown key": a dotted key in a file is --set syntax (``model.hidden_size:
    64`` at the top level), else the field it most likely misspells."""
    if isinstance(key, str) and "." in key:
        return " (a dotted key is --set syntax: in a file, nest it under its section)"
    close = closest_name(key, fields)
    return f" (did you mean {close!r}?)" if close else ""


def from_dict(cls, data: Any, path: str = ""):
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys with their dotted path.

    A null section (``connection:`` with nothing, or only a comment, under it) is refused rather than
    read as ``{}``: it replaces the preset's values of that section when merged, so the run would
    silently get the class defaults instead."""
    if data is None:
        raise ConfigError(path or cls.__name__, "a section cannot be null (write {} or remove the key)")
    if not isinstance(data, dict):
        raise ConfigError(path or cls.__name__, f"expected a mapping, got {type(data).__name__} {_shown(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            dotted = f"{path}.{key}" if path else str(key)
            allowed = ", ".join(sorted(fields))
            raise ConfigError(dotted, f"unknown key{_unknown_key_hint(key, fields)}; allowed: {allowed}")
    kwargs = {}
    for name, value in data.items():
        dotted = f"{path}.{name}" if path else name
        kwargs[name] = _coerce(value, hints[name], dotted)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            dotted = f"{path}.{name}" if path else name
            raise ConfigError(dotted, "required field missing")
    return cls(**kwargs)


def to_dict(obj) -> Any:
    """Dataclass tree -> plain dict (for printing, checkpoints and exported config files)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def deep_merge(base: dict, override: dict) -> dict:
    """Recursive dict merge; ``override`` wins. Mappings merge, everything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_OVERRIDE_SHAPE = "override must look like dotted.key=value (a list item: dotted.key[i].field=value)"


def _override_value(text: str) -> tuple[str, Any]:
    """(dotted key, value parsed as YAML) of ``dotted.key=value``."""
    if "=" not in text:
        raise ConfigError(f"--set {text}", _OVERRIDE_SHAPE)
    dotted, raw = text.split("=", 1)
    value = parse_yaml_text(raw, source=f"--set {text if text.isprintable() else repr(text)}") if raw.strip() else ""
    _refuse_trailing_comment(raw, text)
    return dotted.strip(), value


def override_path(text: str) -> list:
    """The path an override sets: ``data.mixture[1].weight=0.5`` -> ``["data", "mixture", 1, "weight"]``."""
    dotted = override_key(text)
    path: list = []
    for part in dotted.split("."):
        match = re.fullmatch(rf"({_NAME})((?:\[\d+\])*)", part)
        if match is None:
            raise ConfigError(f"--set {text}", _OVERRIDE_SHAPE)
        path.append(match.group(1))
        path += [int(i) for i in re.findall(r"\[(\d+)\]", match.group(2))]
    return path


def dotted_path(path: list) -> str:
    """["data", "mixture", 1, "weight"] -> "data.mixture[1].weight" (the loader's own error paths)."""
    return "".join(f"[{key}]" if isinstance(key, int) else (f".{key}" if i else key) for i, key in enumerate(path))


def apply_override(tree: dict, text: str) -> dict:
    """``tree`` with one ``dotted.key=value`` override applied (a new tree; ``tree`` is not changed).
    Mappings merge as in :func:`deep_merge` and missing keys are made (the strict loader then names
    an unknown one); ``key[i]`` edits item i of a list the tree already holds, which must exist."""
    path = override_path(text)
    _, value = _override_value(text)

    def put(node: Any, depth: int) -> Any:
        key, here = path[depth], dotted_path(path[:depth])
        if isinstance(key, int):
            if node is None:
                raise ConfigError(f"--set {text}", f"the config has no list {here} (add it in the file)")
            if not isinstance(node, list):
                raise ConfigError(f"--set {text}", f"{here} is not a list here (got {_shown(node)})")
            if key >= len(node):
                raise ConfigError(f"--set {text}", f"{here} has {len(node)} item(s): there is no item [{key}] "
                                                   "(add items in the file)")
            out: Any = list(node)
        else:
            if node is None:
                node = {}
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text}", f"{here} is not a mapping here (got {_shown(node)})")
            out = dict(node)
        if depth + 1 < len(path):
            out[key] = put(out[key] if isinstance(key, int) else out.get(key), depth + 1)
        elif isinstance(value, dict) and isinstance(out[key] if isinstance(key, int) else out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
        return out

    return put(tree, 0)


def _refuse_trailing_comment(raw: str, text: str) -> None:
    """A ``#`` after whitespace starts a YAML comment: ``--set "name=demo #2"`` would silently set
    ``demo``. Refused unless the value is quoted (the parsed value then ends where the text does)."""
    if "#" not in raw:
        return
    node = yaml.compose(raw, Loader=yaml.SafeLoader)  # None: the whole value is a comment
    if node is None or node.end_mark.index < len(raw.rstrip()):
        raise ConfigError(f"--set {text}", "'#' starts a YAML comment, which would drop the rest of the value: "
                                           "quote the value (e.g. name='\"demo #2\"')")


def override_key(text: str) -> str:
    """The dotted key an override sets (``a.b=1`` -> ``a.b``)."""
    return text.split("=", 1)[0].strip()


__all__ = [
    "ConfigError", "from_dict", "to_dict", "deep_merge", "apply_override", "dotted_path", "override_key",
    "override_path", "parse_yaml_text",
    "read_yaml_file",
]
