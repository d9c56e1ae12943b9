"""Stage declarations -> IR stages and the flows between them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aspc.frontend import ast, schema
from aspc.frontend.diagnostics import DiagnosticSink, did_you_mean
from aspc.ir.kinds import KIND_RULES
from aspc.ir.graph import PRODUCES, DataSpec, Flow, ModelSpec, Parallel, PoolSpec, Stage, StageKind
from aspc.frontend.options import OptionValues, describe, read_options
from aspc.frontend.resolve import Symbols
from aspc.ir.span import Span
from aspc.frontend.tool_schemas import SchemaError, signature_schema
from aspc.frontend.user_code import UserCodeError, load_function
from aspc.ir.values import Call

_REWARD_SHORTHANDS = ("rule", "python", "model")


@dataclass(frozen=True)
class Resolved:
    """The environment a stage resolves in."""

    symbols: Symbols
    pools: dict[str, PoolSpec]
    models: dict[str, ModelSpec]
    data: dict[str, DataSpec]
    base_dir: Path | None = None  # the .aspl file's folder: Python modules are looked up there
    loaded: dict[str, tuple[str, str] | None] = field(default_factory=dict)  # spec -> its load error


def resolve_stage(decl: ast.Stage, env: Resolved, sink: DiagnosticSink) -> tuple[Stage | None, list[Flow]]:
    if decl.kind not in schema.STAGES:
        hint = did_you_mean(decl.kind, schema.STAGES) or "kinds: " + ", ".join(schema.STAGES)
        sink.error(decl.kind_span, f"unknown stage kind '{decl.kind}'", hint)
        return None, []
    values = read_options(decl.options, schema.STAGES[decl.kind], f"stage '{decl.name}' ({decl.kind})",
                          decl.span, sink)
    model, data, inputs = _classify_inputs(decl, env, sink)
    pool = _pool_of(decl, values, env, sink)
    if not values.valid(*schema.STAGES[decl.kind]) or pool is False:
        return None, []
    options = _kind_options(decl, values, env, data, sink)
    if options is None:
        return None, []
    parallel = Parallel(**{k: values.values.get(k, 1) for k in ("tp", "pp", "dp", "cp", "ep")})
    stage = Stage(decl.name, StageKind(decl.kind), model, data, pool, values.values.get("instances", 1),
                  parallel, tuple(sorted(options.items())), decl.span, values.option_spans)
    return stage, [Flow(src, decl.name, (field,)) for src, field in inputs]


def _classify_inputs(decl: ast.Stage, env: Resolved, sink: DiagnosticSink):
    """Positional arguments are names: at most one model, one data set, and upstream stages."""
    rule = KIND_RULES[StageKind(decl.kind)]
    wants_model, wants_data = rule.needs_model, rule.needs_data
    model = data = None
    inputs: list[tuple[str, str]] = []
    unknown = False
    for arg in decl.args:
        target = env.symbols.decls.get(arg.name) if isinstance(arg, ast.Name) else None
        if not isinstance(arg, ast.Name):
            sink.error(arg.span, f"inputs of a stage are names of models, data and stages, "
                                 f"not {describe(arg)}", "options are written `name = value`")
        elif target is None:
            unknown = True
            sink.error(arg.span, f"unknown name '{arg.name}'", env.symbols.suggest(arg.name))
        elif isinstance(target, ast.Model) and wants_model and model is None:
            model = arg.name
        elif isinstance(target, ast.Data) and wants_data and data is None:
            data = arg.name
        elif isinstance(target, ast.Stage):
            if any(src == arg.name for src, _ in inputs):
                sink.error(arg.span, f"stage '{arg.name}' is given twice as an input")
            elif target.kind in schema.STAGES:
                inputs.append((arg.name, PRODUCES[StageKind(target.kind)]))
        else:
            sink.error(arg.span, _misplaced_input(arg.name, target, decl.kind, model, data))
    if not unknown:
        _missing_inputs(decl, wants_model and model is None, wants_data and data is None, sink)
    return model, data, inputs


def _misplaced_input(name: str, target: ast.Decl, kind: str, model, data) -> str:
    what = type(target).__name__.lower()
    if isinstance(target, ast.Pool):
        return f"'{name}' is a pool; place a stage on it with `on {name}`"
    if (what == "model" and model) or (what == "data" and data):
        return f"a {kind} stage takes one {what}; '{name}' is a second one"
    return f"a {kind} stage takes no {what} input, but '{name}' is a {what}"


def _missing_inputs(decl: ast.Stage, no_model: bool, no_data: bool, sink: DiagnosticSink) -> None:
    if no_model:
        sink.error(decl.kind_span, f"a {decl.kind} stage needs a model as input",
                   f"write `stage {decl.name} = {decl.kind}(MODEL, ...)`")
    if no_data:
        sink.error(decl.kind_span, f"a {decl.kind} stage needs data as input",
                   f"write `stage {decl.name} = {decl.kind}(MODEL, DATA)`")


def _pool_of(decl: ast.Stage, values: OptionValues, env: Resolved, sink: DiagnosticSink):
    """The pool a stage runs on: its `on POOL`, or the only pool; None for host-side stages."""
    if decl.pool is not None:
        if decl.pool.name in env.pools:
            return decl.pool.name
        if not isinstance(env.symbols.decls.get(decl.pool.name), ast.Pool):
            sink.error(decl.pool.span, f"unknown pool '{decl.pool.name}'",
                       env.symbols.suggest(decl.pool.name, ast.Pool))
        return False
    if not _needs_devices(decl, values):
        _no_parallel_without_pool(decl, values, sink)
        return None
    if len(env.pools) == 1:
        return next(iter(env.pools))
    names = ", ".join(env.pools) or "none declared"
    sink.error(decl.kind_span, f"stage '{decl.name}' runs a model and needs a pool",
               f"add `on POOL` after the inputs (pools: {names})")
    return False


def _needs_devices(decl: ast.Stage, values: OptionValues) -> bool:
    if KIND_RULES[StageKind(decl.kind)].needs_model:  # a model stage runs on devices
        return True
    sources = values.values.get("sources")
    sources = sources if isinstance(sources, tuple) else ()
    return bool(values.values.get("model")) or any(
        isinstance(s, Call) and s.func in ("model", "judge") for s in sources)


def _no_parallel_without_pool(decl: ast.Stage, values: OptionValues, sink: DiagnosticSink) -> None:
    for name in ("tp", "pp", "dp", "cp", "ep"):
        if values.given(name):
            sink.error(values.spans[name], f"'{name}' applies to stages that run a model on a pool",
                       "remove it, or place the stage with `on POOL`")


def _kind_options(decl, values: OptionValues, env: Resolved, data: str | None, sink) -> dict | None:
    options = {k: v for k, v in values.values.items() if k not in schema.PLACEMENT_NAMES}
    if decl.kind == "reward":
        return _reward_options(decl, values, env, sink)
    if decl.kind == "train":
        return _train_options(decl, values, options, sink)
    if decl.kind == "advantage":
        return _advantage_options(values, options, sink)
    if decl.kind == "generate" and data in env.data:
        return _generate_options(values, options, env.data[data], sink)
    if decl.kind == "environment":
        return _environment_options(decl, values, options, env, sink)
    return options


def _reward_options(decl: ast.Stage, values: OptionValues, env: Resolved, sink) -> dict | None:
    """The shorthands rule=, python= and model= become one weighted `sources` list."""
    given = [n for n in (*_REWARD_SHORTHANDS, "sources") if values.given(n)]
    if len(given) != 1:
        sink.error(values.spans[given[1]] if given[1:] else decl.kind_span,
                   "a reward stage needs exactly one of rule, python, model or sources",
                   'e.g. `rule = "exact_match"` or `sources = [rule("exact_match"), python("m:f", weight = 0.5)]`')
        return None
    if given[0] != "sources":
        func = given[0]
        param = "name" if func == "rule" else "function" if func == "python" else "model"
        sources = (Call(func, tuple(sorted({param: values[func], "weight": 1.0}.items()))),)
    else:
        sources = values["sources"]
    ok = all(_reward_model_known(s, values, env, sink) for s in sources)
    python = [s.get("function") for s in sources if s.func == "python" and ":" in s.get("function")]
    ok = all([_function_found(spec, "reward", decl, env, sink) for spec in python]) and ok
    return {"sources": sources} if ok else None


def _reward_model_known(source: Call, values: OptionValues, env: Resolved, sink) -> bool:
    ok = True
    if source.func in ("model", "judge") and source.get("model") not in env.models:
        span = values.value_spans.get("sources") or values.value_spans.get("model")
        sink.error(span, f"unknown model '{source.get('model')}' in reward source",
                   env.symbols.suggest(source.get("model"), ast.Model))
        ok = False
    if source.func == "python" and ":" not in source.get("function"):
        span = values.value_spans.get("sources") or values.value_spans.get("python")
        sink.error(span, f"python reward '{source.get('function')}' must be written \"module:function\"")
        ok = False
    return ok


def _train_options(decl, values: OptionValues, options: dict, sink) -> dict | None:
    if values["instances"] != 1:
        sink.error(values.value_spans["instances"], "a train stage is one job: instances must be 1",
                   "use dp for data parallelism")
        return None
    if options["clip_high"] is None:
        options["clip_high"] = 0.28 if options["loss"] == "dapo" else options["clip"]
    if options["mini_batches"] is None:  # one optimizer step per generation phase (plans without it are unchanged)
        del options["mini_batches"]
    if _loss_options(values, options, sink) is None:
        return None
    return _filter_groups_options(values, options, sink)


# dynamic sampling (aspc/controller/dynamic_sampling.py)
FILTER_OPTIONS = ("filter_groups", "max_oversample", "solve_rates", "at_oversample_bound")
DEFAULT_SOLVE_RATES = Call("beta", (("a", 0.5), ("b", 0.5)))  # an assumption, said in docs/language.md


def _filter_groups_options(values: OptionValues, options: dict, sink) -> dict | None:
    """Dynamic sampling's options are in the IR only when it is on (plans without it are unchanged),
    at_oversample_bound only when it stops (plans that pad are unchanged)."""
    if options["filter_groups"]:
        options["max_oversample"] = 4.0 if options["max_oversample"] is None else options["max_oversample"]
        options["solve_rates"] = options["solve_rates"] or DEFAULT_SOLVE_RATES
        if options["at_oversample_bound"] == "pad":
            del options["at_oversample_bound"]
        return options
    for name in FILTER_OPTIONS[1:]:
        if values.given(name):
            sink.error(values.spans[name], f"'{name}' applies only with filter_groups = true",
                       "add filter_groups = true, or remove it")
            return None
    return {k: v for k, v in options.items() if k not in FILTER_OPTIONS}


def _loss_options(values: OptionValues, options: dict, sink) -> dict | None:
    """The loss options stay in the IR only where written (plans without them are unchanged); one
    that would have no effect is refused."""
    for name, problem, fix in _loss_option_problems(values, options):
        sink.error(values.spans[name], problem, fix)
        return None
    for spec in schema.LOSS_OPTIONS:
        if not values.given(spec.name):
            del options[spec.name]
    return options


def _loss_option_problems(values: OptionValues, options: dict) -> list[tuple[str, str, str]]:
    """(option, what is wrong, what to do) for each loss option written where it has no effect."""
    given = {name for name in ("is_cap", "kl_estimator", "dual_clip", "mismatch_cap", "mismatch_floor")
             if values.given(name)}
    found = []
    if "is_cap" in given and options["off_policy"] == "clip":
        found.append(("is_cap", "'is_cap' has no effect with off_policy = clip",
                      "remove it, or set off_policy = tis or decoupled"))
    if "kl_estimator" in given and not options["kl"]:
        found.append(("kl_estimator", "'kl_estimator' has no effect with kl = 0", "remove it, or set kl"))
    if "dual_clip" in given and 0 < options["dual_clip"] <= 1:
        found.append(("dual_clip", f"dual_clip = {options['dual_clip']} would bound the loss below the clipped "
                      "one: it must be above 1", "set it above 1 (verl's default is 3), or 0 to turn it off"))
    if "dual_clip" in given and options["ratio"] == "sequence":
        found.append(("dual_clip", "'dual_clip' has no effect with ratio = sequence (GSPO has no dual clip)",
                      "remove it, or set ratio = token"))
    if "mismatch_cap" in given and options["mismatch"] == "none":
        found.append(("mismatch_cap", "'mismatch_cap' has no effect with mismatch = none",
                      "remove it, or set mismatch"))
    if "mismatch_floor" in given and options["mismatch"] not in ("token_mis", "seq_mis", "auto"):
        found.append(("mismatch_floor", f"'mismatch_floor' has no effect with mismatch = {options['mismatch']}: "
                      "only masked IS has a floor", "remove it, or set mismatch = token_mis, seq_mis or auto"))
    return found


def _advantage_options(values: OptionValues, options: dict, sink) -> dict | None:
    if options["estimator"] == "rloo" and values.given("normalize") and options["normalize"]:
        sink.error(values.spans["normalize"], "RLOO's leave-one-out advantages are not scaled: normalize = true "
                   "would have no effect", "remove it, or use estimator = grpo to divide by the group's std")
        return None
    return options


def _generate_options(values: OptionValues, options: dict, data: DataSpec, sink) -> dict | None:
    for name in schema.ENGINE_OPTIONS:
        if options[name] is None:  # the engine's default, which the cost model and lowering know
            del options[name]
    if options["max_tokens"] is None:
        options["max_tokens"] = data.max_response
    elif options["max_tokens"] > data.max_response:
        sink.error(values.value_spans["max_tokens"],
                   f"max_tokens = {options['max_tokens']} exceeds data '{data.name}' "
                   f"max_response = {data.max_response}", "raise max_response in the data block")
        return None
    return options


def _environment_options(decl, values: OptionValues, options: dict, env: Resolved, sink) -> dict | None:
    for tool in options["tools"]:
        if bool(tool.get("python")) == bool(tool.get("command")):
            sink.error(values.value_spans["tools"],
                       f"tool '{tool.get('name')}' needs exactly one of python = \"module:function\" "
                       "or command = \"...\"")
            return None
    problem = _tools_problem(options)
    if problem:
        option, message, hint = problem
        sink.error(values.value_spans.get(option, decl.kind_span), message, hint)
        return None
    python = [(t.get("name"), t.get("python")) for t in options["tools"] if t.get("python")]
    if not all([_function_found(spec, f"tool '{name}'", decl, env, sink) for name, spec in python]):
        return None
    if options["format"] == "hermes" and not all([_schema_found(t, decl, env, sink) for t in options["tools"]]):
        return None
    return options


def _tools_problem(options: dict) -> tuple[str, str, str] | None:
    """(option, message, hint) of the first thing wrong with an environment's tools, or None."""
    tools = options["tools"]
    names = [t.get("name") for t in tools]
    if len(set(names)) != len(names):
        return "tools", "two tools have the same name", "give each tool its own name"
    if options["format"] == "compact" and len(tools) != 1:
        return ("format", f"the compact tool-call format calls one tool, and this environment has {len(tools)}",
                "use format = hermes, or keep one tool")
    for tool in tools:
        parameters = tool.get("parameters")
        if parameters and not _json_object(parameters):
            return ("tools", f"tool '{tool.get('name')}': parameters is not a JSON object",
                    'write an OpenAI-style JSON schema, e.g. \'{"type": "object", "properties": {...}}\'')
        pairs = [p for p in tool.get("env").split(",") if p.strip()]
        if any("=" not in p or not p.split("=", 1)[0].strip().isidentifier() for p in pairs):
            return "tools", f"tool '{tool.get('name')}': env must read \"NAME=value,NAME2=value\"", ""
    return None


def _json_object(text: str) -> bool:
    import json

    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _function_found(spec: str, user: str, decl: ast.Stage, env: Resolved, sink) -> bool:
    """A "module:function" that a reward or tool names can be imported (beside the .aspl file
    first); checked only when the file's folder is known (`compile_file`, the CLI)."""
    if env.base_dir is None:
        return True
    if spec not in env.loaded:
        env.loaded[spec] = _load_error(spec, env.base_dir)
    if env.loaded[spec] is None:
        return True
    message, hint = env.loaded[spec]
    span = _string_spans(decl).get(spec, decl.kind_span)
    sink.error(span, f'{user} function "{spec}": {message}', hint)
    return False


def _schema_found(tool, decl: ast.Stage, env: Resolved, sink) -> bool:
    """A hermes tool's schema (the chat template's `tools=`) comes from the python function's
    signature when no parameters are declared: it must have one (aspc/frontend/tool_schemas.py)."""
    if env.base_dir is None or not tool.get("python") or tool.get("parameters"):
        return True
    try:
        signature_schema(load_function(tool.get("python"), env.base_dir))
    except UserCodeError:
        return True  # _function_found reported it
    except SchemaError as error:
        span = _string_spans(decl).get(tool.get("python"), decl.kind_span)
        sink.error(span, f'tool \'{tool.get("name")}\' function "{tool.get("python")}": {error.message}', error.hint)
        return False
    return True


def _load_error(spec: str, base_dir: Path) -> tuple[str, str] | None:
    """None when the function loads, else (message, hint)."""
    try:
        load_function(spec, base_dir)
    except UserCodeError as error:
        return error.message, error.hint
    return None


def _string_spans(decl: ast.Stage) -> dict[str, Span]:
    """Every string written in a stage's options (inside lists and calls too), by its text."""
    found: dict[str, Span] = {}
    pending = [o.value for o in decl.options]
    while pending:
        value = pending.pop(0)
        if isinstance(value, ast.Str):
            found.setdefault(value.value, value.span)
        elif isinstance(value, ast.List):
            pending += value.items
        elif isinstance(value, ast.Call):
            pending += [*value.args, *(o.value for o in value.kwargs)]
    return found
