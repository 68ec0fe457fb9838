"""`--help`: the schema described from its own source (config/schema.py), so the keys, types, defaults and comments
are written once."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import textwrap
import types
import typing
from typing import Literal

from config.schema import Config


def describe_schema(cls=Config, width: int = 120) -> str:
    """One aligned line per key (`actor.optim.lr  float  1e-06  comment`), the field's trailing `# comment` in this
    file as its description (wrapped under itself past `width`); comment lines above a field are kept as `#` lines.
    Sections are split by blank lines; a list of dataclasses gives its item fields once, as `placement.pools[].size`."""
    blocks = [[]]
    for row in _schema_rows(cls, ""):
        if row == "":
            blocks.append([])
        else:
            blocks[-1].append(row)
    lines = ["keys (key  type  default  description):"]
    for block in filter(None, blocks):
        cells = [r for r in block if isinstance(r, tuple)]
        widths = [min(max(len(c[i]) for c in cells), cap) for i, cap in ((0, 40), (1, 16), (2, 12))]
        lines.append("")
        for r in block:
            if isinstance(r, tuple):
                head = "  ".join(f"{cell:<{w}}" for cell, w in zip(r[:3], widths))
                r = textwrap.fill(f"{head}  {r[3]}", width - 2, subsequent_indent=" " * (len(head) + 2),
                                  break_long_words=False, break_on_hyphens=False) if r[3] else head.rstrip()
            lines.append(textwrap.indent(r, "  "))
    return "\n".join(lines)


def _schema_rows(cls, prefix: str):
    """(key, type, default, description) per leaf field of `cls`, "# ..." for comment lines, "" between sections."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        above, text = comments.get(f.name, ([], ""))
        if dataclasses.is_dataclass(tp):
            if not prefix:
                yield ""
            if tp.__doc__ and not tp.__doc__.startswith(tp.__name__ + "("):  # not the signature dataclass writes
                yield f"# {tp.__doc__.splitlines()[0]}"
        yield from (f"# {line}" for line in above)
        if dataclasses.is_dataclass(tp):
            yield from _schema_rows(tp, key + ".")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        choices = [typing.get_args(a) for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is Literal]
        if choices:  # in the description, where a long list of choices does not push the columns apart
            text = " | ".join(map(str, choices[0])) + (f"; {text}" if text else "")
        yield key, _type_name(tp), _yaml_text(default), text
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(item):
            yield from _schema_rows(item, key + "[].")


def _field_comments(cls) -> dict[str, tuple[list[str], str]]:
    """{field: (the comment lines right above it, its trailing comment)}, from `name: type = default  # comment`."""
    names = {f.name for f in dataclasses.fields(cls)}
    out, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        comment = re.match(r"\s+#\s?(.*)", line)
        if comment:
            above.append(comment[1])
            continue
        item = re.match(r"\s+(\w+)\s*:[^#]*(?:#\s?(.*))?", line)
        if item and item[1] in names and item[1] not in out:
            out[item[1]] = (above, (item[2] or "").strip())
        above = []
    return out


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return type(args[0]).__name__
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return "None" if tp is type(None) else tp.__name__


def _yaml_text(value) -> str:
    """A default as YAML writes it (null, true, [0.9, 0.999]); strings without quotes unless empty."""
    if isinstance(value, str):
        return value or '""'
    return json.dumps(value)
