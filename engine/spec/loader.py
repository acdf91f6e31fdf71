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
- Reading is bounded (`LIMITS`), because a job file is input the daemon cannot trust: only
  regular files (never a FIFO or a device, which could block a read forever), each at most
  1 MiB and 4 MiB with its includes (64 files at most), at most 64 levels deep and 20,000
  values once aliases and merge keys are expanded, keys of at most 256 characters, integers
  of at most 80. A file beyond a limit is invalid, with a message that says so.

Loading is torch-free: the daemon validates job files with it.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from engine.files import Refused, read_regular_file
from engine.hf import hub
from engine.hf.config import CHOSEN_BY_THE_JOB, FIELDS, HfConfigError, model_fields, same
from engine.spec.schema import JobSpec

INCLUDE_KEY = "include"
MAX_PROBLEMS = 20  # reported per job file; a list of 20,000 bad values need not make 20,000 lines
OVERRIDE_FILE = "<override>"

__all__ = ["INCLUDE_KEY", "LIMITS", "OVERRIDE_FILE", "Limits", "Problem", "SpecError", "dump_schema",
           "load_mapping", "load_spec"]


@dataclass(frozen=True)
class Limits:
    """What one job may take to read: its file, its includes and its overrides together.

    A few hundred bytes of YAML aliases can stand for billions of values, and a job file
    may be a FIFO or a symlink to /dev/zero; without bounds one file could stall or starve
    the daemon that runs every job on the host. Real job files are far inside them.
    """

    file_bytes: int = 1 << 20   # each file
    total_bytes: int = 4 << 20  # the job file and everything it includes
    depth: int = 64             # mappings and sequences inside one another, across includes
    nodes: int = 20_000         # values, counting each alias as the values it stands for
    files: int = 64             # the job file and every file it includes (each time it does)
    key_chars: int = 256        # one key; and 4x this for a whole dotted key (model.attention.kernel)
    scalar_chars: int = 80      # one integer (a long one is slow to convert: base 60, hexadecimal)


LIMITS = Limits()


@dataclass(frozen=True)
class Problem:
    file: str
    line: int | None  # 1-based; None when the problem concerns the file as a whole
    key: str  # dotted key, e.g. "data.seq_len"; "" when no key applies (YAML syntax)
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class Origin(NamedTuple):
    """Where a value was set: a line of a job file or of a file it includes, or an override."""

    file: str
    line: int | None
    note: str | None = None  # appended to messages, e.g. the override that set the value


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec and where each of its dotted keys was set (its key origins)."""

    spec: JobSpec
    origins: Mapping[str, Origin]

    def problem(self, key: str, message: str) -> Problem:
        """A problem with a valid key (one that may not run here), located where the key was set."""
        return _located(key, message, self.origins)


class SpecError(Exception):
    """An invalid job spec. `problems` lists every problem found; str() gives one per line."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


def load_spec(path: str | os.PathLike[str], overrides: Sequence[str] = (), limits: Limits = LIMITS) -> JobSpec:
    """Load, merge, override and validate a job file. Raises SpecError."""
    return load_job(path, overrides, limits).spec


def load_job(path: str | os.PathLike[str], overrides: Sequence[str] = (), limits: Limits = LIMITS) -> LoadedSpec:
    """load_spec, keeping where each key was set. Raises SpecError."""
    file = str(path)
    budget = _Budget(limits)
    tree = _read_file(file, stack=(), prefix="", via=None, budget=budget)
    for text in overrides:
        _apply_override(tree, text, budget)

    origins: dict[str, Origin] = {"": Origin(file, None)}
    data = _unwrap(tree, "", origins)
    if "name" not in data:
        data["name"] = Path(file).stem.lower()
        origins["name"] = Origin(file, None, "the name defaults to the file name")
    if hf_problems := _with_hf_model(data, origins):
        raise SpecError(hf_problems)
    try:
        spec = _with_absolute_paths(JobSpec.model_validate(data), origins)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        problems = [_problem(error, origins) for error in errors[:MAX_PROBLEMS]]
        if len(errors) > MAX_PROBLEMS:
            problems.append(Problem(file, None, "", f"... and {len(errors) - MAX_PROBLEMS} more problems"))
        raise SpecError(problems) from None
    if teacher_problems := _teacher_problems(spec, origins):
        raise SpecError(teacher_problems)
    return LoadedSpec(spec, origins)


def _teacher_problems(spec: JobSpec, origins: Mapping[str, Origin]) -> list[Problem]:
    """A distillation teacher must exist and share the student's vocabulary (engine.distill.source)."""
    if spec.distill is None or spec.distill.offline:  # an offline teacher is the data's: checked with it
        return []
    from engine.distill.source import TeacherError, resolve

    try:
        teacher = resolve(spec.distill.teacher)
    except TeacherError as e:
        return [_located("distill.teacher", str(e), origins)]
    if teacher.vocab_size != spec.model.vocab_size:
        return [_located("distill.teacher", f"{teacher.path}: the teacher's vocabulary has {teacher.vocab_size} "
                         f"tokens, the student's (model.vocab_size) {spec.model.vocab_size}: a teacher must "
                         "share the student's tokenizer", origins)]
    depth = teacher.model.get("n_layers")
    past = [t for _, t in spec.distill.hidden.layers if depth and t > depth] if spec.distill.hidden else []
    if past:
        return [_located("distill.hidden.layers", f"names the teacher's block {past[0]}; {teacher.path} has "
                         f"{depth}", origins)]
    return []


def _absolute(path: str, key: str, origins: Mapping[str, Origin]) -> str:
    """A path relative to the file that names it, as includes are (an override's: the working directory)."""
    path = path if path.startswith("gs://") else os.path.expanduser(path)
    if path.startswith("gs://") or os.path.isabs(path):
        return path
    return str((_base(key, origins) / path).absolute())


def _model_location(value: str, key: str, origins: Mapping[str, Origin]) -> str:
    """A model directory's absolute path, or a Hugging Face Hub id kept as it is (engine.hf.hub): one
    that names nothing on disk."""
    return value if hub.is_hub_id(value, _base(key, origins)) else _absolute(value, key, origins)


def _base(key: str, origins: Mapping[str, Origin]) -> Path:
    origin = origins.get(key)
    return Path(origin.file).parent if origin is not None and os.path.isfile(origin.file) else Path.cwd()


def _with_absolute_paths(spec: JobSpec, origins: Mapping[str, Origin]) -> JobSpec:
    """The worker, started elsewhere, gets absolute dataset and teacher paths; the daemon an absolute TensorBoard
    directory."""
    if spec.data.dataset is not None:
        spec.data.dataset = _absolute(spec.data.dataset, "data.dataset", origins)
    for i, entry in enumerate(spec.data.mixture):
        entry.dataset = _absolute(entry.dataset, f"data.mixture.{i}.dataset", origins)
    if spec.logging.tensorboard is not None:
        spec.logging.tensorboard = _absolute(spec.logging.tensorboard, "logging.tensorboard", origins)
    if spec.distill is not None and not spec.distill.offline:
        spec.distill.teacher = _model_location(spec.distill.teacher, "distill.teacher", origins)
    return spec


def _with_hf_model(data: dict, origins: dict[str, Origin]) -> list[Problem]:
    """Fill in the model section from model.init_from's config.json; each value the job sets must agree."""
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("init_from"), str):
        return []
    path = model["init_from"] = _model_location(model["init_from"], "model.init_from", origins)
    try:
        fields = model_fields(path)
    except HfConfigError as e:
        return [_located("model.init_from", str(e), origins)]
    problems = []
    for key, value in fields.items():
        if key not in model:
            model[key] = value
            origins[f"model.{key}"] = origins.get("model.init_from", Origin("", None))._replace(
                note=f"from {FIELDS[key]} in {path}/config.json")
        elif isinstance(model[key], dict) and isinstance(value, dict):  # a section: key by key
            for sub, theirs in value.items():
                if sub not in model[key]:
                    model[key][sub] = theirs
                elif sub not in CHOSEN_BY_THE_JOB and not same(model[key][sub], theirs):
                    problems.append(_located(f"model.{key}.{sub}", f"{model[key][sub]!r} differs from {theirs!r} "
                                             f"({FIELDS[key]}) in {path}/config.json", origins))
        elif not same(model[key], value):
            problems.append(_located(f"model.{key}", f"{model[key]!r} differs from {FIELDS[key]} = {value!r} in "
                                     f"{path}/config.json", origins))
    return problems


def load_mapping(path: str | os.PathLike[str], limits: Limits = LIMITS) -> dict[str, Any]:
    """A YAML file's top-level mapping as plain data, read within the same limits as job
    files (for other files the daemon reads, such as tpud.yaml). Raises SpecError."""
    return _unwrap(_read_file(str(path), stack=(), prefix="", via=None, budget=_Budget(limits), empty_ok=True), "", {})


def dump_schema() -> str:
    """JobSpec's JSON Schema for editors, with `include` allowed in every mapping."""
    schema = JobSpec.model_json_schema()
    schema.pop("required", None)  # `name` defaults to the file name, and included fragments have none
    _allow_include(schema)
    return json.dumps({"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}, indent=2)


# --- Reading YAML into a tree that remembers where each value came from ---


@dataclass
class _Entry:
    value: Any  # dict[str, _Entry] for a mapping, list[_Entry] for a sequence, else a plain scalar
    origin: Origin


class _LimitError(yaml.YAMLError):
    def __init__(self, message: str, mark: yaml.Mark | None):
        super().__init__(message)
        self.message, self.problem_mark = message, mark


class _Budget:
    """The limits left for one load_spec(), shared by its files and overrides."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.bytes = limits.total_bytes
        self.files = limits.files
        self.composed = limits.nodes  # nodes YAML builds, aliases counted once
        self.expanded = limits.nodes  # values they make, each alias counted in full

    def read(self, file: str) -> bytes:
        self.files -= 1
        if self.files < 0:
            raise Refused(f"the job file includes more than {self.limits.files - 1} files (counting repeats)")
        raw = read_regular_file(file, self.limits.file_bytes)
        self.bytes -= len(raw)
        if self.bytes < 0:
            raise Refused(f"the job file and its includes are larger than {self.limits.total_bytes:,} bytes together")
        return raw

    def depth(self, depth: int, mark: yaml.Mark | None) -> None:
        if depth > self.limits.depth:
            raise _LimitError(f"nested more than {self.limits.depth} levels deep (the limit for job files)", mark)

    def key(self, prefix: str, name: str, mark: yaml.Mark | None) -> str:
        """The dotted key `prefix.name`, unless it is too long: every value's key is kept for messages."""
        if len(name) > self.limits.key_chars or len(prefix) + len(name) > 4 * self.limits.key_chars:
            raise _LimitError(f"a key longer than {self.limits.key_chars} characters, or a dotted key longer "
                              f"than {4 * self.limits.key_chars} (the limits for job files)", mark)
        return _join(prefix, name)

    def compose(self, mark: yaml.Mark | None) -> None:
        self.composed -= 1
        if self.composed < 0:
            raise _LimitError(f"more than {self.limits.nodes:,} values (the limit for job files)", mark)

    def expand(self, mark: yaml.Mark | None) -> None:
        self.expanded -= 1
        if self.expanded < 0:
            raise _LimitError(f"more than {self.limits.nodes:,} values once aliases and merge keys are expanded "
                              "(the limit for job files)", mark)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads exponent notation without a dot (3e-4, 1E5) as floats, and
    stops composing at the budget's depth and size."""

    def __init__(self, stream: bytes | str, budget: _Budget, depth: int = 0):
        """`depth`: how deep the including file's `include:` sits (0 for the job file itself)."""
        super().__init__(stream)
        self.budget, self._depth = budget, depth

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        # PyYAML converts hexadecimal, octal and base-60 integers of any length (in quadratic time
        # for base 60), outside Python's own limit on decimal digits.
        if len(node.value) > self.budget.limits.scalar_chars:
            raise ValueError(f"an integer of more than {self.budget.limits.scalar_chars} characters")
        return super().construct_yaml_int(node)

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        mark = self.peek_event().start_mark
        self._depth += 1
        try:
            self.budget.depth(self._depth, mark)
            self.budget.compose(mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _fail(origin: Origin, key: str, message: str) -> SpecError:
    return SpecError([Problem(origin.file, origin.line, key, message)])


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _read_file(file: str, stack: tuple[str, ...], prefix: str, via: Origin | None,
               budget: _Budget, empty_ok: bool = False, depth: int = 0) -> dict[str, _Entry]:
    """The mapping in `file` with its includes resolved, keyed as if it sat at `prefix`.

    `via` is the `include:` key that named the file (None for the job file itself); problems
    about the file as a whole are reported there. `stack` is the chain of including files.
    """
    where, key = (via, _join(prefix, INCLUDE_KEY)) if via else (Origin(file, None), "")
    try:
        raw = budget.read(file)  # bytes: the YAML reader detects the encoding
    except (OSError, Refused, ValueError) as e:  # ValueError: a NUL in the name
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
        raise _fail(where, key, f"cannot read {file}: {reason}" if via else f"cannot read: {reason}") from None

    loader = None
    try:
        loader = _Loader(raw, budget, depth)
        node = loader.get_single_node()
        if node is None and empty_ok:
            return {}
        if not isinstance(node, yaml.MappingNode):
            found = "empty" if node is None else f"a {node.id}"
            what = f"included file {file}" if via else "the top level"
            raise _fail(where, key, f"{what} must be a mapping of keys, but it is {found}")
        return _FileReader(loader, file, (*stack, file), budget).mapping(node, prefix, depth=depth + 1)
    except _LimitError as e:
        raise _fail(Origin(file, _mark_line(e.problem_mark)), "", e.message) from None
    except yaml.reader.ReaderError as e:  # not text: invalid UTF-8, binary, control characters
        line = raw[: e.position].count(b"\n") + 1
        character = f"character U+{e.character:04X}" if e.encoding == "unicode" else f"byte 0x{e.character:02x}"
        raise _fail(Origin(file, line), "", f"not a YAML text file: {character} ({e.reason})") from None
    except yaml.YAMLError as e:
        line = _mark_line(getattr(e, "problem_mark", None))
        raise _fail(Origin(file, line), "", f"invalid YAML: {getattr(e, 'problem', None) or e}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _mark_line(mark: yaml.Mark | None) -> int | None:
    return mark.line + 1 if mark else None


_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80
_short.maxlevel = 3  # a value from a file can nest aliases a billion values deep: show its top


def short_repr(value: Any) -> str:
    """repr() for messages, bounded in size and in work however large or nested the value."""
    try:
        return _short.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an integer too long for str()
        return f"<a {type(value).__name__}>"


class _FileReader:
    """Turns one file's composed nodes into _Entry trees, following its includes.

    Every value visited is charged to the budget, so aliases (which YAML composes once and
    we expand wherever they appear) and merge keys cannot multiply past it.
    """

    def __init__(self, loader: _Loader, file: str, stack: tuple[str, ...], budget: _Budget):
        self.loader, self.file, self.stack, self.budget = loader, file, stack, budget

    def value(self, node: yaml.Node, key: str, depth: int) -> Any:
        self.budget.depth(depth, node.start_mark)
        self.budget.expand(node.start_mark)
        if isinstance(node, yaml.MappingNode):
            return self.mapping(node, key, depth)
        if isinstance(node, yaml.SequenceNode):
            return [
                _Entry(self.value(item, _join(key, i), depth + 1), Origin(self.file, _line(item)))
                for i, item in enumerate(node.value)
            ]
        return self.scalar(node, key)

    def scalar(self, node: yaml.Node, key: str) -> Any:
        try:
            return self.loader.construct_object(node)
        except yaml.YAMLError:
            raise
        except Exception as e:  # noqa: BLE001 - PyYAML's constructors fail in many ways (!!bool x, !!int '')
            raise _fail(Origin(self.file, _line(node)), key, f"cannot read the value: {e}") from None

    def mapping(self, node: yaml.MappingNode, prefix: str, depth: int) -> dict[str, _Entry]:
        self._reject_duplicates(node, prefix)
        merged: dict[str, _Entry] = {}  # YAML merge keys (<<: *anchor): the mapping's own keys win
        own: dict[str, _Entry] = {}
        included: dict[str, _Entry] = {}
        for key_node, value_node in node.value:
            origin = Origin(self.file, _line(key_node))
            if key_node.tag == _MERGE_TAG:
                merged.update(self._merge_key(value_node, prefix, depth, origin))
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise _fail(origin, prefix, f"keys must be strings, got a {key_node.id}")
            name = self.scalar(key_node, prefix)
            if not isinstance(name, str):
                raise _fail(origin, prefix, f"keys must be strings, got {short_repr(name)}")
            key = self.budget.key(prefix, name, key_node.start_mark)
            if name == INCLUDE_KEY:
                included = self._includes(value_node, prefix, origin, depth)
            else:
                own[name] = _Entry(self.value(value_node, key, depth + 1), origin)
        return _merge(included, {**merged, **own})  # merge keys are shallow; includes merge deep

    def _merge_key(self, node: yaml.Node, prefix: str, depth: int, origin: Origin) -> dict[str, _Entry]:
        """`<<: *a` or `<<: [*a, *b]` (the earlier one wins), as YAML's merge key type says."""
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        merged: dict[str, _Entry] = {}
        for source in reversed(sources):
            if not isinstance(source, yaml.MappingNode):
                raise _fail(origin, _join(prefix, "<<"), f"a merge key takes mappings, got a {source.id}")
            merged.update(self.value(source, prefix, depth))
        return merged

    def _includes(self, node: yaml.Node, prefix: str, origin: Origin, depth: int) -> dict[str, _Entry]:
        key = _join(prefix, INCLUDE_KEY)
        items = node.value if isinstance(node, yaml.SequenceNode) else [node]
        for item in items:
            self.budget.expand(item.start_mark)
        names = [self.scalar(item, key) if isinstance(item, yaml.ScalarNode) else None for item in items]
        if not all(isinstance(n, str) and n for n in names):
            raise _fail(origin, key, f"expected a file name or a list of file names, got {short_repr(names)}")
        merged: dict[str, _Entry] = {}
        for name in names:
            file = os.path.normpath(os.path.join(os.path.dirname(self.file), name))
            if "\0" in name:
                raise _fail(origin, key, f"a file name with a NUL character: {short_repr(name)}")
            if any(os.path.realpath(f) == os.path.realpath(file) for f in self.stack):
                cycle = " -> ".join((*self.stack, file))
                raise _fail(origin, key, f"include cycle: {cycle}")
            merged = _merge(merged, _read_file(file, self.stack, prefix, via=origin, budget=self.budget, depth=depth))
        return merged

    def _reject_duplicates(self, node: yaml.MappingNode, prefix: str) -> None:
        # PyYAML silently keeps the last of two equal keys; in a job file that is a typo.
        first: dict[str, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                if key_node.value in first:
                    raise _fail(
                        Origin(self.file, _line(key_node)), _join(prefix, key_node.value),
                        f"duplicate key (first set on line {first[key_node.value]})",
                    )
                first[key_node.value] = _line(key_node)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _merge(base: dict[str, _Entry], top: dict[str, _Entry]) -> dict[str, _Entry]:
    """Deep merge: mappings merge key by key; any other value in `top` replaces `base`'s."""
    out = dict(base)
    for key, entry in top.items():
        old = out.get(key)
        if old is not None and isinstance(old.value, dict) and isinstance(entry.value, dict):
            entry = _Entry(_merge(old.value, entry.value), entry.origin)
        out[key] = entry
    return out


def _unwrap(value: Any, key: str, origins: dict[str, Origin]) -> Any:
    """Plain dicts and lists from an _Entry tree, recording each dotted key's origin."""
    if isinstance(value, dict):
        return {k: _unwrap_entry(entry, _join(key, k), origins) for k, entry in value.items()}
    if isinstance(value, list):
        return [_unwrap_entry(entry, _join(key, i), origins) for i, entry in enumerate(value)]
    return value


def _unwrap_entry(entry: _Entry, key: str, origins: dict[str, Origin]) -> Any:
    origins[key] = entry.origin
    return _unwrap(entry.value, key, origins)


# --- Overrides ---


def _apply_override(tree: dict[str, _Entry], text: str, budget: _Budget) -> None:
    dotted, sep, raw = text.partition("=")
    parts = dotted.strip().split(".")
    origin = Origin(OVERRIDE_FILE, None, f"override {short_repr(text)}")
    if not sep or not all(parts):
        raise _fail(origin, "", "expected KEY=VALUE with a dotted KEY such as train.max_steps=50, "
                                f"got {short_repr(text)}")
    key = ".".join(parts)
    loader = None
    try:
        loader = _Loader(raw, budget)
        node = loader.get_single_node()
        value = None if node is None else _FileReader(loader, OVERRIDE_FILE, (), budget).value(node, key, 1)
    except _LimitError as e:
        raise _fail(origin, key, f"the value {short_repr(raw)} is {e.message}") from None
    except SpecError as e:
        raise _fail(origin, key, f"cannot read the value {short_repr(raw)}: {e.problems[0].message}") from None
    except yaml.YAMLError as e:
        reason = getattr(e, "problem", None) or getattr(e, "reason", None) or type(e).__name__
        raise _fail(origin, key, f"cannot parse the value {short_repr(raw)} as YAML: {reason}") from None
    finally:
        if loader is not None:
            loader.dispose()

    mapping = tree
    for part in parts[:-1]:
        entry = mapping.get(part)
        if entry is None or not isinstance(entry.value, dict):
            entry = mapping[part] = _Entry({}, origin)
        mapping = entry.value
    mapping[parts[-1]] = _Entry(_reorigin(value, origin), origin)


def _reorigin(value: Any, origin: Origin) -> Any:
    """An override's _Entry tree with every part attributed to the override."""
    if isinstance(value, dict):
        return {k: _Entry(_reorigin(e.value, origin), origin) for k, e in value.items()}
    if isinstance(value, list):
        return [_Entry(_reorigin(e.value, origin), origin) for e in value]
    return value


# --- Validation errors, located ---


def _problem(error: dict[str, Any], origins: Mapping[str, Origin]) -> Problem:
    loc = error["loc"]
    if error["type"] == "extra_forbidden":
        message = _unknown_key(loc)
    else:
        message = error["msg"].removeprefix("Value error, ")
        if not isinstance(error.get("input"), (dict, BaseModel)):  # a section's dict is noise
            message += f" (got {short_repr(error['input'])})"
    return _located(".".join(map(str, loc)), message, origins)


def _located(key: str, message: str, origins: Mapping[str, Origin]) -> Problem:
    # A missing key has no origin of its own: report it at the nearest parent that has one.
    parent = key
    while parent not in origins:
        parent = parent.rpartition(".")[0]
    origin = origins[parent]
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
