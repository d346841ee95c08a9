"""Strict YAML loading of specs, with every problem turned into one readable SpecError.

Each problem is one line::

    <file>: <key.path[0].sub>: <what is wrong>; got <value>. Fix: <what to do>.

The helpers :func:`read_yaml` and :func:`validation_problems` are generic over the model so
other specs (jobs) can share the same loading and error format.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Hashable, Sequence, Sized
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from trainpod.errors import SpecError
from trainpod.paths import ClusterRecord
from trainpod.spec.cluster import NOTHING, ClusterSpec, SpecProblems

_MAX_GOT = 60
_EXAMPLE = "see examples/cluster.yaml for a complete spec"


def load_cluster_spec(path: str | Path) -> ClusterSpec:
    """Read, parse and validate the cluster spec at ``path``.

    Relative paths inside the spec resolve against the file's directory. Raises
    :class:`SpecError` naming the file for a missing/unreadable file, a YAML syntax error
    (with line and column) or any number of validation problems (all of them, one a line).
    """
    path = Path(path)
    data = read_yaml(path)
    return parse_cluster_spec(data, source=str(path), base_dir=path.absolute().parent)


def parse_cluster_spec(data: object, source: str, base_dir: Path) -> ClusterSpec:
    """Validate already-parsed YAML/JSON ``data`` as a cluster spec.

    ``source`` names the input in messages; relative paths resolve against ``base_dir``.
    Accepts the output of ``spec.model_dump(mode="json")`` and returns an equal spec.
    Raises :class:`SpecError` holding every problem found.
    """
    check_top_level(data, source, "name: <cluster name>")
    try:
        return ClusterSpec.model_validate(data, context={"base_dir": Path(base_dir).absolute()})
    except ValidationError as err:
        raise SpecError("\n".join(validation_problems(err, source, ClusterSpec))) from None


def format_problem(source: str, where: str, reason: str, got: Any, fix: str) -> str:
    """One problem line; ``got`` is left out when it is ``NOTHING``."""
    got_text = "" if got is NOTHING else f"; got {_short(got)}"
    return f"{source}: {where}: {_sentence(reason + got_text)} Fix: {_sentence(fix)}"


def read_yaml(path: Path) -> object:
    """Parse the YAML file at ``path``, refusing duplicate keys; SpecError on any failure."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(
            format_problem(
                source,
                "(file)",
                f"spec file not found (resolved to {path.absolute()})",
                NOTHING,
                "check the path, or start from examples/cluster.yaml",
            )
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(
            format_problem(
                source,
                "(file)",
                f"cannot read the spec file: {err}",
                NOTHING,
                "give the path of a readable UTF-8 YAML file",
            )
        ) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as err:
        raise SpecError(_yaml_problem(source, err)) from None
    except yaml.YAMLError as err:
        raise SpecError(
            format_problem(source, "(file)", f"invalid YAML: {err}", NOTHING, _EXAMPLE)
        ) from None


def check_top_level(data: object, source: str, first_key: str) -> None:
    """Raise SpecError unless ``data`` is a non-empty mapping."""
    if data is None or data == {}:
        raise SpecError(
            format_problem(
                source,
                "(top level)",
                "the spec is empty",
                NOTHING,
                f"write a YAML mapping starting with `{first_key}`; {_EXAMPLE}",
            )
        )
    if not isinstance(data, dict):
        raise SpecError(
            format_problem(
                source,
                "(top level)",
                f"the spec must be a mapping of keys, not a {type(data).__name__}",
                data,
                f"write `key: value` lines starting with `{first_key}`; {_EXAMPLE}",
            )
        )


def validation_problems(err: ValidationError, source: str, model: type[BaseModel]) -> list[str]:
    """Every problem in ``err`` as a formatted line, in input order, without duplicates."""
    lines: list[str] = []
    for error in err.errors():
        ctx = error.get("ctx") or {}
        found = ctx.get("error")
        if error["type"] == "value_error" and isinstance(found, SpecProblems):
            for p in found.problems:
                loc = (*error["loc"], *p.loc)
                lines.append(format_problem(source, format_loc(loc), p.reason, p.got, p.fix))
        elif not _is_echo(error):
            reason, got, fix = _explain(error, model)
            loc = tuple(error["loc"])
            where = format_loc(loc)
            if error["type"] == "invalid_key":  # the last part is a key, not a list index
                where = f"{format_loc(loc[:-1])}.{loc[-1]!r}" if loc[:-1] else repr(loc[-1])
            lines.append(format_problem(source, where, reason, got, fix))
    return list(dict.fromkeys(lines))


def _is_echo(error: ErrorDetails) -> bool:
    """A ``too_short`` that only repeats that the list's items failed, not that it is short."""
    got, min_length = error["input"], (error.get("ctx") or {}).get("min_length", 0)
    return error["type"] == "too_short" and isinstance(got, Sized) and len(got) >= min_length


def format_loc(loc: Sequence[str | int]) -> str:
    """``("instance_groups", 0, "count")`` -> ``instance_groups[0].count``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            if isinstance(key, Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(source: str, err: yaml.MarkedYAMLError) -> str:
    mark = err.problem_mark or err.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
    problem = err.problem or "invalid YAML"
    if "duplicate key" in problem:
        fix = "keep only one of them; later lines would otherwise silently win"
    elif "'\\t'" in problem:
        fix = "indent with spaces, not tabs"
    else:
        fix = (
            "fix the YAML syntax near that spot: check the indentation, the colon after each "
            "key, and quote values that contain ': ' or start with a special character"
        )
    return format_problem(source, where, f"YAML syntax error: {problem}", NOTHING, fix)


def _explain(error: ErrorDetails, model: type[BaseModel]) -> tuple[str, Any, str]:
    """Reason, received value and fix for one plain pydantic error."""
    kind, loc, got = error["type"], tuple(error["loc"]), error["input"]
    ctx = error.get("ctx") or {}
    field = next((p for p in reversed(loc) if isinstance(p, str)), "")
    if kind in ("extra_forbidden", "invalid_key"):
        allowed = _allowed_keys(_type_at(model, loc[:-1]))
        fix = "remove it or check the spelling; allowed keys here: " + ", ".join(allowed)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
        if close:
            fix += f"; did you mean {close[0]!r}?"
        reason = "keys must be text" if kind == "invalid_key" else "unknown key"
        return reason, got, fix
    if kind == "missing":
        return "required key is missing", NOTHING, _missing_fix(model, loc)
    if kind == "literal_error":
        choices = typing.get_args(_type_at(model, loc))
        values = ", ".join(str(c) for c in choices) or str(ctx.get("expected"))
        return "not an allowed value", got, f"use one of: {values}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        keys = ", ".join(_allowed_keys(_type_at(model, loc)))
        return "expected a mapping", got, f"write indented `key: value` lines; keys: {keys}"
    if kind == "too_short":
        return _too_short(field, got, ctx)
    # Bounds read better as 0 than 0.0 when a float field has a whole-number bound.
    nice = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in ctx.items()}
    if kind in _REASONS:
        reason = _REASONS[kind].format(**nice)
    else:
        reason = error["msg"][:1].lower() + error["msg"][1:]
    return reason, got, _TYPE_FIXES.get(kind, _EXAMPLE).format(**nice)


_REASONS = {
    "int_type": "expected a whole number",
    "float_type": "expected a number",
    "bool_type": "expected true or false",
    "string_type": "expected text",
    "path_type": "expected a path",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
}


_TYPE_FIXES = {
    "int_type": "use a whole number without quotes",
    "int_parsing": "use a whole number without quotes",
    "int_from_float": "use a whole number without quotes",
    "float_type": "use a number without quotes (seconds for `_s` keys)",
    "float_parsing": "use a number without quotes (seconds for `_s` keys)",
    "finite_number": "use a finite number",
    "bool_type": "use true or false without quotes",
    "bool_parsing": "use true or false without quotes",
    "string_type": "use text; quote it if YAML reads it as a number, date or boolean",
    "path_type": "use a path as text",
    "greater_than": "use a value greater than {gt}",
    "greater_than_equal": "use {ge} or more",
    "less_than": "use a value less than {lt}",
    "less_than_equal": "use {le} or less",
    "tuple_type": "write a YAML list (one `- item` per line, or [a, b])",
    "list_type": "write a YAML list (one `- item` per line, or [a, b])",
}


def _too_short(field: str, got: Any, ctx: dict[str, Any]) -> tuple[str, Any, str]:
    fix = f"list at least {ctx.get('min_length', 1)} item(s)"
    if field == "partitions":
        fix += ", or remove `partitions:` to get one partition `default` of all compute groups"
    elif field == "groups":
        fix += "; name the compute groups this partition holds"
    elif field == "instance_groups":
        fix += "; each group needs at least `name:` and `count:`"
    return "the list is empty", got, fix


def _missing_fix(model: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    key = str(loc[-1])
    annotation = _type_at(model, loc)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"add `{key}:` with indented keys: {', '.join(_allowed_keys(annotation))}"
    item = _item_type(annotation)
    if isinstance(item, type) and issubclass(item, BaseModel):
        required = [n for n, f in item.model_fields.items() if f.is_required()]
        return f"add `{key}:` with a list of `- {required[0]}: ...` entries; each needs: " + (
            ", ".join(required)
        )
    placeholders = {int: "<int>", float: "<seconds>", bool: "true", Path: "<path>"}
    if item is not None:
        return f"add `{key}: [<{key.rstrip('s')}>, ...]`"
    return f"add `{key}: {placeholders.get(annotation, f'<{key}>')}`"


def _strip(annotation: Any) -> Any:
    """Remove ``Annotated`` and ``| None`` wrappers."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            rest = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(rest) != 1:
                return annotation
            annotation = rest[0]
        else:
            return annotation


def _item_type(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (tuple, list):
        return _strip(typing.get_args(annotation)[0])
    return None


def _type_at(model: type[BaseModel], loc: Sequence[str | int]) -> Any:
    """The (stripped) type expected at ``loc`` below ``model``; None if unknown."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            current = _item_type(current)
        elif isinstance(current, type) and issubclass(current, BaseModel):
            info = current.model_fields.get(part)
            current = _strip(info.annotation) if info else None
        else:
            return None
    return current


def _allowed_keys(model: Any) -> list[str]:
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _short(value: Any) -> str:
    text = repr(str(value) if isinstance(value, os.PathLike) else value)
    return text if len(text) <= _MAX_GOT else text[: _MAX_GOT - 3] + "..."


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "?", "!")) else text + "."


def load_recorded_spec(record: ClusterRecord) -> ClusterSpec:
    """The spec a cluster was created from, as its record keeps it (paths resolve against the
    original spec file's directory). Light to import: agents call it at start-up."""
    return parse_cluster_spec(
        record.spec, source=record.spec_path, base_dir=Path(record.spec_path).parent
    )
