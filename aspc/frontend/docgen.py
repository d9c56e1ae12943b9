"""Option reference tables for docs/language.md, generated from the schema so docs cannot drift.

`python -m aspc.frontend.docgen` prints them; a test checks that docs/language.md contains each table.
"""
from __future__ import annotations

from aspc.frontend import schema
from aspc.ir.values import format_value


def _default(spec: schema.OptionSpec) -> str:
    if spec.default is schema.REQUIRED:
        return "required"
    if spec.default is None or spec.default == "":
        return "—"
    return "`" + format_value(spec.default).strip('"') + "`"


def _allowed(spec: schema.OptionSpec) -> str:
    if spec.type == "enum":
        return " \\| ".join(f"`{c}`" for c in spec.choices)
    if spec.type in ("call", "calls"):
        suffix = ", ..." if spec.type == "calls" else ""
        bracket = spec.type == "calls"
        return "[" * bracket + " \\| ".join(f"`{c}(...)`" for c in spec.choices) + suffix + "]" * bracket
    parts = []
    if spec.lo is not None:
        parts.append(f"{'>' if spec.lo_open else '≥'} {spec.lo:g}")
    if spec.hi is not None:
        parts.append(f"≤ {spec.hi:g}")
    return f"{spec.type} " + ", ".join(parts) if parts else spec.type


def table(title: str, specs: dict[str, schema.OptionSpec]) -> str:
    rows = [f"#### {title}", "", "| option | value | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {_allowed(s)} | {_default(s)} | {s.doc} |" for s in specs.values()]
    return "\n".join(rows) + "\n"


def call_table() -> str:
    rows = ["#### Call values", "", "| call | parameters (positional order) | meaning |", "|---|---|---|"]
    for call in schema.CALLS.values():
        params = ", ".join([f"`{call.rest}`"] * bool(call.rest) + [
            f"`{p.name}`" + ("" if p.default is schema.REQUIRED else f"={_default(p).strip('`')}")
            for p in call.params])
        rows.append(f"| `{call.func}` | {params} | {call.doc} |")
    return "\n".join(rows) + "\n"


def all_tables() -> list[str]:
    tables = [table("model = PRESET", schema.MODEL_PRESET), table("model = custom", schema.MODEL_CUSTOM),
              table("model = hf(DIR)", schema.MODEL_HF),
              table("model = frozen(NAME)", schema.MODEL_FROZEN), table("data = jsonl(FILE)", schema.DATA_JSONL),
              table("data = synthetic(TASK)", schema.DATA_SYNTHETIC)]
    tables += [table(f"stage = {kind}(...)", specs) for kind, specs in schema.STAGES.items()]
    tables += [table("schedule asp", schema.SCHEDULES["asp"]), call_table()]
    return tables


if __name__ == "__main__":
    print("\n".join(all_tables()))
