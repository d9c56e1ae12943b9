"""Tool schemas (OpenAI-style functions): derived from a python tool's signature, or declared; checked
at `aspc check`; carried by the Ascend launch plan as the chat template's `tools=`."""
from __future__ import annotations

import json
from typing import Literal

import pytest

from aspc.backends.ascend.lowering import lower
from aspc.frontend.compiler import compile_file
from aspc.frontend.diagnostics import AsplError
from aspc.frontend.tool_schemas import SchemaError, signature_schema, tool_schema, type_schema
from aspc.cli.toolchain import compile_with_passes, run_schedule
from conftest import ROOT


def search(query: str, limit: int = 5, scale: float = 1.0, tags: list[int] | None = None,
           exact: bool = False, mode: Literal["fast", "slow"] = "fast", extra=None, **options) -> str:
    """Search the index for a query.

    The second paragraph is not part of the description."""
    return query


def test_a_signature_becomes_a_json_schema_of_its_keywords():
    assert signature_schema(search) == {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer", "default": 5},
            "scale": {"type": "number", "default": 1.0},
            "tags": {"type": ["array", "null"], "items": {"type": "integer"}},
            "exact": {"type": "boolean", "default": False},
            "mode": {"type": "string", "enum": ["fast", "slow"], "default": "fast"},
            "extra": {},  # unannotated: the function gets whatever JSON value the model wrote
        },
        "required": ["query"],
    }


def test_the_description_is_the_docstrings_first_paragraph():
    schema = tool_schema({"name": "search", "python": "m:search"}, search)
    assert schema["type"] == "function" and schema["function"]["name"] == "search"
    assert schema["function"]["description"] == "Search the index for a query."


def test_declared_parameters_and_description_win():
    declared = '{"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}'
    tool = {"name": "search", "python": "m:search", "parameters": declared, "description": "Find pages."}
    assert tool_schema(tool, search)["function"] == {"name": "search", "description": "Find pages.",
                                                     "parameters": json.loads(declared)}


def test_a_command_tool_takes_any_object_as_json_on_stdin():
    parameters = tool_schema({"name": "python", "command": "python3 -"}, None)["function"]["parameters"]
    assert parameters["type"] == "object" and "properties" not in parameters
    assert "JSON text on its standard input" in parameters["description"]


def test_dicts_unions_and_lists():
    assert type_schema(dict[str, float]) == {"type": "object", "additionalProperties": {"type": "number"}}
    assert type_schema(int | str) == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert type_schema(list) == {"type": "array"}
    assert type_schema(list[list[str]]) == {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}
    with pytest.raises(SchemaError, match="JSON object keys are strings"):
        type_schema(dict[int, str])


class Point:
    pass


def takes_a_class(where: Point) -> str:
    return str(where)


def takes_varargs(*numbers: int) -> int:
    return sum(numbers)


def takes_positional_only(x: int, /) -> int:
    return x


@pytest.mark.parametrize("function, message", [
    (takes_a_class, "parameter 'where': annotation Point has no JSON schema"),
    (takes_varargs, "parameter 'numbers' cannot be passed by keyword"),
    (takes_positional_only, "parameter 'x' cannot be passed by keyword"),
])
def test_what_no_json_keyword_can_carry_is_a_schema_error(function, message):
    with pytest.raises(SchemaError, match=message):
        signature_schema(function)


def test_the_ascend_launch_plan_carries_the_tools_schema():
    launch = lower(compile_with_passes(ROOT / "pipelines" / "agentic_7b.aspl").plan())
    [runner] = [s for s in launch.stages if s.role == "tool-runner (host CPU)"]
    [schema] = runner.config["tools_schema"]
    assert schema["type"] == "function" and schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["type"] == "object"
    json.dumps(runner.config)  # the launch plan is JSON


HERMES = (ROOT / "pipelines" / "tiny_agentic.aspl").read_text().replace("format = compact", "format = hermes")
TOOLS = '''
def calc(expression: str, exact: bool = True) -> str:
    return expression

def spread(*numbers):
    return sum(numbers)
'''


def _hermes_pipeline(tmp_path, function: str = "calc"):
    (tmp_path / "schema_tools.py").write_text(TOOLS)
    path = tmp_path / "p.aspl"
    path.write_text(HERMES.replace("tiny_tools:calc", f"schema_tools:{function}"))
    return path


def test_a_hermes_launch_plan_derives_a_python_tools_schema(tmp_path):
    path = _hermes_pipeline(tmp_path)
    launch = lower(run_schedule(compile_file(path)).plan(), base_dir=tmp_path)
    [runner] = [s for s in launch.stages if s.kind == "environment"]
    assert runner.config["tools_schema"] == [{"type": "function", "function": {
        "name": "calc", "description": "multiply, add or subtract two numbers",  # declared in tiny_agentic.aspl
        "parameters": {"type": "object", "required": ["expression"],
                       "properties": {"expression": {"type": "string"},
                                      "exact": {"type": "boolean", "default": True}}}}}]


def test_a_compact_launch_plan_has_no_tools_schema():
    launch = lower(compile_with_passes(ROOT / "pipelines" / "tiny_agentic.aspl").plan())
    [runner] = [s for s in launch.stages if s.kind == "environment"]
    assert runner.config["tools_schema"] is None


def test_lowering_without_the_modules_folder_says_what_is_missing(tmp_path):
    path = _hermes_pipeline(tmp_path)
    plan = run_schedule(compile_file(path)).plan()
    with pytest.raises(ValueError, match="tool 'calc' .*cannot find Python module 'schema_tools'"):
        lower(plan)


def test_a_hermes_tool_without_a_schema_is_a_located_error(tmp_path):
    path = _hermes_pipeline(tmp_path, "spread")
    with pytest.raises(AsplError) as info:
        compile_file(path)
    [error] = info.value.diagnostics
    assert error.message == ("tool 'calc' function \"schema_tools:spread\": parameter 'numbers' cannot be passed "
                             "by keyword, as a tool call passes it")
    line = path.read_text().splitlines()[error.span.line - 1]
    assert line[error.span.column - 1:].startswith('"schema_tools:spread"')
    assert "parameters" in error.hint


def test_a_compact_tool_needs_no_schema(tmp_path):
    path = _hermes_pipeline(tmp_path, "spread")
    path.write_text(path.read_text().replace("format = hermes", "format = compact"))
    assert compile_file(path).graph.stage("env").option("tools")[0].get("python") == "schema_tools:spread"
