"""The settings tables of docs/architecture.md, generated from the pydantic schemas.

    python docs/settings_tables.py           print the tables
    python docs/settings_tables.py --write   rewrite them in docs/architecture.md

Each table sits between `<!-- settings: NAME -->` and `<!-- end settings -->`; everything else
in the document is written by hand. tests/test_architecture_doc.py fails when a table differs
from what the schema generates, so a setting added, renamed or given another default is
documented in the same commit.
"""

from __future__ import annotations

import argparse
import enum
import re
import sys
import types
import typing
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
_BLOCK = re.compile(r"(<!-- settings: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end settings -->)", re.DOTALL)


def _models() -> dict[str, type[BaseModel]]:
    sys.path.insert(0, str(REPO))
    from engine.spec.schema import JobSpec
    from tpud.settings import Settings

    return {"job": JobSpec, "tpud-yaml": Settings}


def _model_of(annotation: object) -> type[BaseModel] | None:
    """The model a field holds, directly or as `Model | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return _model_of(models[0])
    return None


def _type(annotation: object) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is typing.Annotated:  # a constrained type inside another (PositiveInt | None)
        bounds = _bounds(list(args[1:]))
        return _type(args[0]) + (f" ({bounds})" if bounds else "")
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(_type(a) for a in args if a is not Ellipsis) + "]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(str(m.value) for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: list) -> str:
    words = []
    for m in metadata:
        for kind, sign in ((Gt, ">"), (Ge, ">="), (Lt, "<"), (Le, "<=")):
            if isinstance(m, kind):
                words.append(f"{sign} {getattr(m, kind.__name__.lower())}")
        if isinstance(m, MinLen) and m.min_length:
            words.append(f"at least {m.min_length} long")
        if isinstance(m, MaxLen):
            words.append(f"at most {m.max_length} long")
        if getattr(m, "pattern", None):
            words.append(f"matches `{m.pattern}`")
    return ", ".join(words)


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return f"`{value}`" if isinstance(value, str) else str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every field, sections expanded in place."""
    out = []
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        nested = _model_of(field.annotation)
        item = None
        if typing.get_origin(field.annotation) is list:
            item = _model_of(typing.get_args(field.annotation)[0])
        kind = "section" if nested is not None else _type(field.annotation)
        if nested is not None and _model_of(field.annotation) is not field.annotation:
            kind = "section or null"
        if item is not None:
            kind = "list of sections"
        bounds = _bounds(field.metadata)
        about = field.description or (nested.__doc__ or "").strip().split("\n\n")[0] if nested is not None \
            else field.description or ""
        out.append((f"`{key}`", _cell(kind + (f" ({bounds})" if bounds else "")), _default(field), _cell(about)))
        if nested is not None:
            out += rows(nested, key + ".")
        if item is not None:
            out += rows(item, key + "[].")
    return out


def table(model: type[BaseModel]) -> str:
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| {k} | {t} | {d} | {m} |" for k, t, d, m in rows(model)]
    return "\n".join(lines) + "\n"


def render(doc: str) -> str:
    """`doc` with every settings block regenerated."""
    models = _models()

    def block(match: re.Match) -> str:
        name = match["name"]
        if name not in models:
            raise KeyError(f"docs/architecture.md names an unknown settings table {name!r} (one of {list(models)})")
        return match.group(1) + table(models[name]) + match.group(4)

    return _BLOCK.sub(block, doc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables in docs/architecture.md")
    args = parser.parse_args()
    if args.write:
        DOC.write_text(render(DOC.read_text()))
        return 0
    for name, model in _models().items():
        print(f"<!-- settings: {name} -->\n{table(model)}<!-- end settings -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
