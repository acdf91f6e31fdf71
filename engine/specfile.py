"""Job files: YAML in, a validated `JobSpec` out, and every problem located at FILE:LINE.

The rules a job file follows:

- `include:` (a path or a list of paths, relative to the file that names it) may appear in
  any mapping. The included file must hold a mapping, and that mapping is merged at the
  level where `include:` appears: at the top of a job it supplies whole sections
  (`model: {...}`), under `attention:` it supplies the attention section's keys (`kernel:`,
  `splash:`). Includes merge first, in order (a later one wins); the mapping's own keys then
  win over all of them. Merging is deep: mappings merge key by key, anything else replaces.
- `name:` defaults to the job file's stem, lowercased.
- Numbers like `3e-4` are floats (YAML 1.2), not the strings PyYAML's YAML 1.1 rules make them.
- Overrides (`train.max_steps=50`) are applied last; each sets one dotted key to a value
  parsed as YAML, replacing what was there (a mapping value is not merged).

Loading is torch-free: the daemon validates job files with it.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from engine.config import JobSpec

INCLUDE_KEY = "include"
OVERRIDE_FILE = "<override>"

__all__ = ["INCLUDE_KEY", "OVERRIDE_FILE", "Problem", "SpecError", "dump_schema", "load_spec"]


@dataclass(frozen=True)
class Problem:
    file: str
    line: int | None  # 1-based; None when the problem concerns the file as a whole
    key: str  # dotted key, e.g. "data.seq_len"; "" when no key applies (YAML syntax)
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class SpecError(Exception):
    """An invalid job spec. `problems` lists every problem found; str() gives one per line."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


def load_spec(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> JobSpec:
    """Load, merge, override and validate a job file. Raises SpecError."""
    file = str(path)
    tree = _read_file(file, stack=(), prefix="", via=None)
    for text in overrides:
        _apply_override(tree, text)

    origins: dict[str, _Origin] = {"": _Origin(file, None)}
    data = _unwrap(tree, "", origins)
    if "name" not in data:
        data["name"] = Path(file).stem.lower()
        origins["name"] = _Origin(file, None, "the name defaults to the file name")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(_problem(error, origins) for error in e.errors(include_url=False)) from None


def dump_schema() -> str:
    """JobSpec's JSON Schema for editors, with `include` allowed in every mapping."""
    schema = JobSpec.model_json_schema()
    schema.pop("required", None)  # `name` defaults to the file name, and included fragments have none
    _allow_include(schema)
    return json.dumps({"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}, indent=2)


# --- Reading YAML into a tree that remembers where each value came from ---


class _Origin(NamedTuple):
    file: str
    line: int | None
    note: str | None = None  # appended to messages, e.g. the override that set the value


@dataclass
class _Entry:
    value: Any  # dict[str, _Entry] for a mapping, list[_Entry] for a sequence, else a plain scalar
    origin: _Origin


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads exponent notation without a dot (3e-4, 1E5) as floats."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _fail(origin: _Origin, key: str, message: str) -> SpecError:
    return SpecError([Problem(origin.file, origin.line, key, message)])


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _read_file(file: str, stack: tuple[str, ...], prefix: str, via: _Origin | None) -> dict[str, _Entry]:
    """The mapping in `file` with its includes resolved, keyed as if it sat at `prefix`.

    `via` is the `include:` key that named the file (None for the job file itself); problems
    about the file as a whole are reported there. `stack` is the chain of including files.
    """
    where, key = (via, _join(prefix, INCLUDE_KEY)) if via else (_Origin(file, None), "")
    try:
        raw = Path(file).read_bytes()  # bytes: the YAML reader detects the encoding
    except OSError as e:
        raise _fail(where, key, f"cannot read {file}: {e.strerror}") from None

    loader = _Loader(raw)
    try:
        node = loader.get_single_node()
        if not isinstance(node, yaml.MappingNode):
            found = "empty" if node is None else f"a {node.id}"
            what = f"included file {file}" if via else "the top level"
            raise _fail(where, key, f"{what} must be a mapping of keys, but it is {found}")
        return _FileReader(loader, file, (*stack, file)).mapping(node, prefix)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise _fail(_Origin(file, line), "", f"invalid YAML: {getattr(e, 'problem', None) or e}") from None
    finally:
        loader.dispose()


class _FileReader:
    """Turns one file's composed nodes into _Entry trees, following its includes."""

    def __init__(self, loader: _Loader, file: str, stack: tuple[str, ...]):
        self.loader, self.file, self.stack = loader, file, stack

    def value(self, node: yaml.Node, key: str) -> Any:
        if isinstance(node, yaml.MappingNode):
            return self.mapping(node, key)
        if isinstance(node, yaml.SequenceNode):
            return [
                _Entry(self.value(item, _join(key, i)), _Origin(self.file, _line(item)))
                for i, item in enumerate(node.value)
            ]
        return self.loader.construct_object(node)

    def mapping(self, node: yaml.MappingNode, prefix: str) -> dict[str, _Entry]:
        self._reject_duplicates(node, prefix)
        self.loader.flatten_mapping(node)  # YAML merge keys (<<: *anchor) become ordinary pairs
        own: dict[str, _Entry] = {}
        included: dict[str, _Entry] = {}
        for key_node, value_node in node.value:
            origin = _Origin(self.file, _line(key_node))
            name = self.loader.construct_object(key_node)
            if not isinstance(name, str):
                raise _fail(origin, _join(prefix, name), f"keys must be strings, got {name!r}")
            if name == INCLUDE_KEY:
                included = self._includes(value_node, prefix, origin)
            else:
                own[name] = _Entry(self.value(value_node, _join(prefix, name)), origin)
        return _merge(included, own)

    def _includes(self, node: yaml.Node, prefix: str, origin: _Origin) -> dict[str, _Entry]:
        key = _join(prefix, INCLUDE_KEY)
        names = self.loader.construct_object(node, deep=True)
        if isinstance(names, str):
            names = [names]
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise _fail(origin, key, f"expected a file name or a list of file names, got {names!r}")
        merged: dict[str, _Entry] = {}
        for name in names:
            file = os.path.normpath(os.path.join(os.path.dirname(self.file), name))
            if any(os.path.realpath(f) == os.path.realpath(file) for f in self.stack):
                cycle = " -> ".join((*self.stack, file))
                raise _fail(origin, key, f"include cycle: {cycle}")
            merged = _merge(merged, _read_file(file, self.stack, prefix, via=origin))
        return merged

    def _reject_duplicates(self, node: yaml.MappingNode, prefix: str) -> None:
        # PyYAML silently keeps the last of two equal keys; in a job file that is a typo.
        first: dict[str, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in first:
                    raise _fail(
                        _Origin(self.file, _line(key_node)), _join(prefix, key_node.value),
                        f"duplicate key (first set on line {first[key_node.value]})",
                    )
                first[key_node.value] = _line(key_node)


def _merge(base: dict[str, _Entry], top: dict[str, _Entry]) -> dict[str, _Entry]:
    """Deep merge: mappings merge key by key; any other value in `top` replaces `base`'s."""
    out = dict(base)
    for key, entry in top.items():
        old = out.get(key)
        if old is not None and isinstance(old.value, dict) and isinstance(entry.value, dict):
            entry = _Entry(_merge(old.value, entry.value), entry.origin)
        out[key] = entry
    return out


def _unwrap(value: Any, key: str, origins: dict[str, _Origin]) -> Any:
    """Plain dicts and lists from an _Entry tree, recording each dotted key's origin."""
    if isinstance(value, dict):
        return {k: _unwrap_entry(entry, _join(key, k), origins) for k, entry in value.items()}
    if isinstance(value, list):
        return [_unwrap_entry(entry, _join(key, i), origins) for i, entry in enumerate(value)]
    return value


def _unwrap_entry(entry: _Entry, key: str, origins: dict[str, _Origin]) -> Any:
    origins[key] = entry.origin
    return _unwrap(entry.value, key, origins)


# --- Overrides ---


def _apply_override(tree: dict[str, _Entry], text: str) -> None:
    dotted, sep, raw = text.partition("=")
    parts = dotted.strip().split(".")
    origin = _Origin(OVERRIDE_FILE, None, f"override {text!r}")
    if not sep or not all(parts):
        raise _fail(origin, "", f"expected KEY=VALUE with a dotted KEY such as train.max_steps=50, got {text!r}")
    try:
        value = yaml.load(raw, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as e:
        raise _fail(origin, ".".join(parts), f"cannot parse the value {raw!r} as YAML: {e}") from None

    mapping = tree
    for part in parts[:-1]:
        entry = mapping.get(part)
        if entry is None or not isinstance(entry.value, dict):
            entry = mapping[part] = _Entry({}, origin)
        mapping = entry.value
    mapping[parts[-1]] = _Entry(_entries(value, origin), origin)


def _entries(value: Any, origin: _Origin) -> Any:
    """An _Entry tree for a plain value, every part of it from `origin`."""
    if isinstance(value, dict):
        return {str(k): _Entry(_entries(v, origin), origin) for k, v in value.items()}
    if isinstance(value, list):
        return [_Entry(_entries(v, origin), origin) for v in value]
    return value


# --- Validation errors, located ---


def _problem(error: dict[str, Any], origins: dict[str, _Origin]) -> Problem:
    loc = error["loc"]
    key = ".".join(map(str, loc))
    # A missing key has no origin of its own: report it at the nearest parent that has one.
    parent = key
    while parent not in origins:
        parent = parent.rpartition(".")[0]
    origin = origins[parent]

    if error["type"] == "extra_forbidden":
        message = _unknown_key(loc)
    else:
        message = error["msg"].removeprefix("Value error, ")
        if not isinstance(error.get("input"), (dict, BaseModel)):  # a section's dict is noise
            message += f" (got {error['input']!r})"
    if origin.note:
        message += f" [{origin.note}]"
    return Problem(origin.file, origin.line, key, message)


def _unknown_key(loc: tuple[str | int, ...]) -> str:
    fields = _section_fields(loc[:-1])
    if not fields:
        return "unknown key"
    message = f"unknown key; expected one of: {', '.join(fields)}"
    close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
    return f"{message}; did you mean {close[0]!r}?" if close else message


def _section_fields(loc: tuple[str | int, ...]) -> list[str]:
    """Field names of the spec section at `loc` (empty when loc is not a section)."""
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        section = field.annotation if field else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return []
        model = section
    return list(model.model_fields)


def _allow_include(schema: Any) -> None:
    """Add `include` to every object schema that lists its properties."""
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict):
            schema["properties"][INCLUDE_KEY] = {
                "description": "File(s) merged into this mapping, relative to this file; own keys win.",
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
            }
        for value in schema.values():
            _allow_include(value)
    elif isinstance(schema, list):
        for value in schema:
            _allow_include(value)
