"""The OpenAI-style function schema of each tool of an environment: what a chat template takes as `tools=`.

A tool's schema is {"type": "function", "function": {"name", "description", "parameters"}}:
  - parameters: the declared `parameters` JSON when given. Otherwise, for a python tool, derived
    from the function's signature (`signature_schema`); for a command tool, any object, saying that
    the command reads it as JSON text on its standard input: that is what the runner writes there
    for a hermes call (aspc/rl/tool_runner.py).
  - description: the declared one, else (python tools) the first paragraph of the docstring.

The derivation follows how the ToolRunner calls a python tool for a hermes call: `function(**arguments)`.
Every parameter is a property, and one without a default is required. Annotations map to JSON
schema: int integer, float number, str string, bool boolean, list[X] an array of X, dict and
dict[str, X] an object, Literal[...] an enum, X | None X or null, a union anyOf. An unannotated
parameter (or Any, object) gets no type constraint: the function receives the JSON value the model
wrote, whatever it is, and a schema claiming "string" would be false. What cannot be passed as a
JSON keyword — *args, a positional-only parameter, an annotation such as a class or a callable —
is a SchemaError (a diagnostic at `aspc check`; declare `parameters` instead).
"""
from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aspc.frontend.user_code import UserCodeError, load_function

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_UNCONSTRAINED = (Any, object)
MAPPED = "int, float, str, bool, list[...], dict[str, ...], Literal[...], X | None, or no annotation"
_HINT = f"declare parameters = '{{JSON schema}}' on the tool, or annotate with {MAPPED}"


class SchemaError(ValueError):
    """A python tool's signature that no JSON schema describes; `hint` says what to do."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message, self.hint = message, hint


def tool_schemas(tools, base_dir: Path | None) -> list[dict]:
    """The schemas of declared tools (Call values or dicts with .get), python modules looked up
    beside the .aspl file (`base_dir`) first. Raises SchemaError when one cannot be had."""
    return [_named_schema(tool, base_dir) for tool in tools]


def tool_schema(tool, function: Callable | None) -> dict:
    """One tool's schema; `function` is its python function, needed only when it declares no parameters."""
    declared = tool.get("parameters") or ""
    if declared:
        parameters = json.loads(declared)
    elif tool.get("python"):
        parameters = signature_schema(function)
    else:
        parameters = {"type": "object", "description": f"any object: `{tool.get('command')}` reads it as JSON text "
                                                       "on its standard input"}
    description = tool.get("description") or (_docstring_summary(function) if tool.get("python") else "")
    return {"type": "function",
            "function": {"name": tool.get("name"), "description": description, "parameters": parameters}}


def signature_schema(function: Callable) -> dict:
    """The JSON schema of the keyword arguments `function` takes."""
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(function)
    except Exception as error:  # no signature (some builtins), an annotation naming nothing: the user's code
        raise SchemaError(f"its signature cannot be read: {error}", _HINT) from None
    properties, required = {}, []
    for name, parameter in signature.parameters.items():
        if parameter.kind == parameter.VAR_KEYWORD:
            continue  # **kwargs takes any further keys, as an object's additional properties do
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.POSITIONAL_ONLY):
            raise SchemaError(f"parameter '{name}' cannot be passed by keyword, as a tool call passes it", _HINT)
        properties[name] = _parameter_schema(name, parameter, hints)
        if parameter.default is parameter.empty:
            required.append(name)
    schema: dict = {"type": "object", "properties": properties}
    return {**schema, "required": required} if required else schema



def _parameter_schema(name: str, parameter: inspect.Parameter, hints: dict) -> dict:
    try:
        schema = type_schema(hints.get(name, Any))
    except SchemaError as error:
        raise SchemaError(f"parameter '{name}': {error.message}", _HINT) from None
    if parameter.default is not parameter.empty and parameter.default is not None and _is_json(parameter.default):
        schema["default"] = parameter.default
    return schema


def type_schema(hint) -> dict:
    """The JSON schema of values of the annotation `hint`."""
    if any(hint is u for u in _UNCONSTRAINED):
        return {}
    if isinstance(hint, type) and hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is list or origin is list:
        return {"type": "array", **({"items": type_schema(args[0])} if args else {})}
    if hint is dict or origin is dict:
        return _object_schema(args)
    if origin is typing.Literal:
        return _enum_schema(args)
    if origin in (typing.Union, types.UnionType):
        return _union_schema(args)
    raise SchemaError(f"annotation {_name(hint)} has no JSON schema")


def _object_schema(args: tuple) -> dict:
    if not args:
        return {"type": "object"}
    if args[0] is not str:
        raise SchemaError(f"dict keys are {_name(args[0])}, and JSON object keys are strings")
    values = type_schema(args[1])
    return {"type": "object", **({"additionalProperties": values} if values else {})}


def _enum_schema(values: tuple) -> dict:
    kinds = {_SCALARS.get(type(v)) for v in values}
    if None in kinds:
        raise SchemaError(f"Literal{list(values)} holds a value JSON cannot spell")
    return {"type": kinds.pop(), "enum": list(values)} if len(kinds) == 1 else {"enum": list(values)}


def _union_schema(args: tuple) -> dict:
    options = [type_schema(a) for a in args]
    if {} in options:
        return {}  # one member takes anything, so the union does
    others = [o for o in options if o != {"type": "null"}]
    if len(others) == 1 and len(options) == 2 and isinstance(others[0].get("type"), str):
        return {**others[0], "type": [others[0]["type"], "null"]}  # X | None
    return {"anyOf": options}


def _name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _docstring_summary(function: Callable | None) -> str:
    """The docstring's first paragraph on one line."""
    doc = inspect.getdoc(function) if function is not None else None
    if not doc:
        return ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _named_schema(tool, base_dir: Path | None) -> dict:
    """tool_schema, its errors naming the tool."""
    try:
        return tool_schema(tool, _function_of(tool, base_dir))
    except (SchemaError, UserCodeError) as error:
        raise SchemaError(f"tool '{tool.get('name')}' (\"{tool.get('python')}\"): {error.message}",
                          error.hint) from None


def _function_of(tool, base_dir: Path | None) -> Callable | None:
    if not tool.get("python") or (tool.get("parameters") and tool.get("description")):
        return None  # nothing to read from it
    return load_function(tool.get("python"), base_dir)
