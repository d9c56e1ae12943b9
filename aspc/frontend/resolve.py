"""Declarations other than stages -> IR specs: names, pools, models, data and the schedule."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from aspc.frontend import ast, schema
from aspc.frontend.diagnostics import DiagnosticSink, Suggestions, did_you_mean
from aspc.frontend.hf_config import HfConfigError, read_hf_model
from aspc.frontend.lengths import check_lengths
from aspc.ir.facts import ModelArch, hardware_table, model_presets
from aspc.ir.graph import DataSpec, ModelSpec, PoolSpec, ScheduleSpec
from aspc.frontend.options import INVALID, OptionValues, convert, describe, read_options
from aspc.ir.span import Span


@dataclass
class Symbols:
    """Every declaration by name: one namespace for pools, models, data and stages."""

    pipeline: ast.Pipeline | None = None
    schedule: ast.Schedule | None = None
    decls: dict[str, ast.Decl] = field(default_factory=dict)
    _suggestions: dict = field(default_factory=dict)  # kind -> Suggestions, built on first use

    def of(self, kind: type) -> list:
        return [d for d in self.decls.values() if isinstance(d, kind)]

    def suggest(self, word: str, kind: type | None = None) -> str:
        """'did you mean ...?' among the declarations (of one kind), or ''."""
        if kind not in self._suggestions:
            names = self.decls if kind is None else [d.name for d in self.of(kind)]
            self._suggestions[kind] = Suggestions(names)
        return self._suggestions[kind].hint(word)


def collect_symbols(program: ast.Program, sink: DiagnosticSink) -> Symbols:
    symbols = Symbols()
    for decl in program.decls:
        if isinstance(decl, ast.Pipeline):
            symbols.pipeline = _single(symbols.pipeline, decl, "pipeline", sink)
        elif isinstance(decl, ast.Schedule):
            symbols.schedule = _single(symbols.schedule, decl, "schedule", sink)
        elif decl.name in symbols.decls:
            first = symbols.decls[decl.name]
            sink.error(decl.span, f"'{decl.name}' is already defined",
                       "every pool, model, data and stage needs its own name",
                       notes=[(first.span, "first defined here")])
        else:
            symbols.decls[decl.name] = decl
    if symbols.pipeline is None:
        sink.error(Span.point(program.file), "missing `pipeline NAME` declaration",
                   "start the file with a line such as `pipeline my_grpo`")
    return symbols


def _single(existing, decl, what: str, sink: DiagnosticSink):
    if existing is not None:
        sink.error(decl.span, f"a file has one {what} declaration; this is a second one",
                   notes=[(existing.span, "the first one is here")])
        return existing
    return decl


def resolve_pool(pool: ast.Pool, sink: DiagnosticSink) -> PoolSpec | None:
    table = hardware_table()
    count_spec = schema.OptionSpec("count", "int", doc="devices in the pool", lo=1)
    count = convert(pool.count, count_spec, sink)
    if pool.hardware not in table:
        hint = did_you_mean(pool.hardware.lower(), table) or "known: " + ", ".join(table)
        sink.error(pool.hardware_span, f"unknown hardware '{pool.hardware}'", hint)
        return None
    return None if count is INVALID else PoolSpec(pool.name, table[pool.hardware], count, pool.span)


def resolve_models(symbols: Symbols, sink: DiagnosticSink, aspl_dir: Path | None = None) -> dict[str, ModelSpec]:
    """Presets, custom and hf(...) models first, then frozen copies of them (in any order)."""
    models = {}
    decls = symbols.of(ast.Model)
    for model in (m for m in decls if m.source != "frozen"):
        spec = _resolve_hf(model, aspl_dir, sink) if model.source == "hf" else _resolve_model(model, sink)
        if spec is not None:
            models[model.name] = spec
    for model in (m for m in decls if m.source == "frozen"):
        spec = _resolve_frozen(model, symbols, models, sink)
        if spec is not None:
            models[model.name] = spec
    return models


def _resolve_model(model: ast.Model, sink: DiagnosticSink) -> ModelSpec | None:
    if model.args is not None:
        sink.error(model.source_span, f"model source '{model.source}' takes no arguments",
                   "write `model NAME = PRESET { options }`")
        return None
    if model.source == "custom":
        values = read_options(model.options, schema.MODEL_CUSTOM, f"custom model '{model.name}'",
                              model.span, sink)
        arch = _custom_arch(values, model, sink) if values.valid(*schema.MODEL_CUSTOM) else None
    else:
        arch = model_presets().get(model.source)
        if arch is None:
            _unknown_model_source(model, sink)
            return None
        values = read_options(model.options, schema.MODEL_PRESET, f"model '{model.name}'",
                              model.span, sink)
    if arch is None or not values.valid("dtype", "checkpoint", "seed"):
        return None
    return ModelSpec(model.name, model.source, arch, values["dtype"], values["checkpoint"],
                     values["seed"], None, model.span)


def _resolve_hf(model: ast.Model, aspl_dir: Path | None, sink: DiagnosticSink) -> ModelSpec | None:
    """`hf("DIR")`: the shape and dtype from DIR/config.json (DIR relative to the .aspl file)."""
    args = model.args or ()
    if len(args) != 1 or not isinstance(args[0], ast.Str):
        sink.error(model.source_span, 'hf(...) takes one checkpoint directory: hf("checkpoints/qwen2.5-0.5b")')
        return None
    values = read_options(model.options, schema.MODEL_HF, f"model '{model.name}'", model.span, sink)
    try:
        found = read_hf_model(aspl_dir / args[0].value if aspl_dir else Path(args[0].value))
    except HfConfigError as error:
        sink.error(args[0].span, error.message, error.hint)
        return None
    for message, hint in found.warnings:
        sink.warning(args[0].span, message, hint)
    if not values.valid("dtype"):
        return None
    return ModelSpec(model.name, "hf", found.arch, values["dtype"] or found.dtype, args[0].value,
                     span=model.span)


def _unknown_model_source(model: ast.Model, sink: DiagnosticSink) -> None:
    known = list(model_presets()) + ["custom", "frozen", "hf"]
    hint = did_you_mean(model.source.lower(), known) or (
        "use a preset (" + ", ".join(model_presets()) + "), `custom { layers = .. }`, `hf(\"DIR\")` or "
        "`frozen(NAME)`")
    sink.error(model.source_span, f"unknown model '{model.source}'", hint)


def _custom_arch(values: OptionValues, model: ast.Model, sink: DiagnosticSink) -> ModelArch | None:
    v = dict(values.values)
    v["kv_heads"] = v["kv_heads"] or v["heads"]
    v["ffn"] = v["ffn"] or 4 * v["hidden"]
    v["expert_ffn"] = (v["expert_ffn"] or v["ffn"]) if v["experts"] else 0
    if v["head_dim"] is None and v["hidden"] % v["heads"]:
        sink.error(values.value_spans.get("heads", model.span),
                   f"hidden = {v['hidden']} is not divisible by heads = {v['heads']}",
                   "change heads, or give head_dim explicitly")
        return None
    v["head_dim"] = v["head_dim"] or v["hidden"] // v["heads"]
    if v["heads"] % v["kv_heads"]:
        sink.error(values.value_spans.get("kv_heads", model.span),
                   f"heads = {v['heads']} is not a multiple of kv_heads = {v['kv_heads']}")
        return None
    if v["experts"] and not 1 <= v["top_k"] <= v["experts"]:
        sink.error(values.value_spans.get("top_k", model.span),
                   f"a model with {v['experts']} experts needs 1 <= top_k <= {v['experts']}, "
                   f"got top_k = {v['top_k']}")
        return None
    arch_keys = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "experts",
                 "top_k", "expert_ffn", "tied", "max_seq")
    return ModelArch(**{k: v[k] for k in arch_keys})


def _resolve_frozen(model: ast.Model, symbols: Symbols, models: dict[str, ModelSpec],
                    sink: DiagnosticSink) -> ModelSpec | None:
    args = model.args or ()
    if len(args) != 1 or not isinstance(args[0], ast.Name):
        sink.error(model.source_span, "frozen(...) takes the name of one model",
                   "write `model ref = frozen(actor)`")
        return None
    target = args[0].name
    if target not in models:
        if not isinstance(symbols.decls.get(target), ast.Model):  # a model that failed has its own error
            _unknown_reference(args[0], symbols, ast.Model, sink)
        return None
    values = read_options(model.options, schema.MODEL_FROZEN, f"model '{model.name}'", model.span, sink)
    if not values.valid("dtype"):
        return None
    base = models[target]
    dtype = values["dtype"] or base.dtype
    return replace(base, name=model.name, dtype=dtype, frozen_of=target, span=model.span)


def _unknown_reference(name: ast.Name, symbols: Symbols, kind: type, sink: DiagnosticSink) -> None:
    wanted = kind.__name__.lower()
    decl = symbols.decls.get(name.name)
    if decl is not None:
        sink.error(name.span, f"'{name.name}' is a {type(decl).__name__.lower()}, not a {wanted}")
        return
    sink.error(name.span, f"unknown {wanted} '{name.name}'", symbols.suggest(name.name, kind))


def resolve_data(data: ast.Data, aspl_dir: Path | None, sink: DiagnosticSink) -> DataSpec | None:
    if data.source not in ("jsonl", "synthetic"):
        hint = did_you_mean(data.source, ("jsonl", "synthetic")) or \
            'use jsonl("file.jsonl") or synthetic("arith")'
        sink.error(data.source_span, f"unknown data source '{data.source}'", hint)
        return None
    specs = schema.DATA_JSONL if data.source == "jsonl" else schema.DATA_SYNTHETIC
    location = _data_location(data, sink)
    values = read_options(data.options, specs, f"data '{data.name}'", data.span, sink)
    if location is None or not values.valid(*specs):
        return None
    check_lengths(data, values, sink)
    if data.source == "jsonl" and aspl_dir is not None and not (aspl_dir / location).exists():
        sink.warning(data.args[0].span, f"data file '{location}' does not exist",
                     "`aspc run` needs it; compile and simulate do not")
    return DataSpec(data.name, data.source, location, values["prompts_per_step"], values["group"],
                    values["max_prompt"], values["max_response"], values["seed"],
                    values.values.get("size", 0), values["response_lengths"],
                    values["prompt_lengths"], data.span, values.option_spans)


def _data_location(data: ast.Data, sink: DiagnosticSink) -> str | None:
    args = data.args or ()
    if data.source == "jsonl":
        if len(args) != 1 or not isinstance(args[0], ast.Str):
            sink.error(data.source_span, 'jsonl(...) takes one file name: jsonl("data/train.jsonl")')
            return None
        return args[0].value
    if len(args) != 1 or not isinstance(args[0], (ast.Str, ast.Name)):
        sink.error(data.source_span, "synthetic(...) takes one task name: "
                                     + ", ".join(schema.SYNTHETIC_TASKS))
        return None
    task = args[0].value if isinstance(args[0], ast.Str) else args[0].name
    if task not in schema.SYNTHETIC_TASKS:
        hint = did_you_mean(task, schema.SYNTHETIC_TASKS) or "tasks: " + ", ".join(schema.SYNTHETIC_TASKS)
        sink.error(args[0].span, f"unknown synthetic task {describe(args[0])}", hint)
        return None
    return task


def resolve_schedule(decl: ast.Schedule | None, file: str, sink: DiagnosticSink) -> ScheduleSpec | None:
    if decl is None:
        values = read_options((), schema.SCHEDULES["asp"], "schedule asp", Span.point(file), sink)
        return ScheduleSpec("asp", _schedule_options(values.values), None)
    specs = schema.SCHEDULES.get(decl.kind)
    if specs is None:
        hint = did_you_mean(decl.kind, schema.SCHEDULES) or "choose asp, sync or sync-naive"
        sink.error(decl.span, f"unknown schedule '{decl.kind}'", hint)
        return None
    values = read_options(decl.options, specs, f"schedule {decl.kind}", decl.span, sink)
    if not values.valid(*specs):
        return None
    return ScheduleSpec(decl.kind, _schedule_options(values.values), decl.span, values.option_spans)


def _schedule_options(values: dict) -> tuple:
    """The options in name order; a search bound not given is left out (nothing is searched)."""
    return tuple(sorted((k, v) for k, v in values.items() if not (k in schema.SEARCH_BOUNDS and v is None)))
