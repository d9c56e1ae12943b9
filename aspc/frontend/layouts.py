"""Layout transformations at the source level: "colocated on all devices", the fair sync baseline.

A synchronous framework (verl, MindSpeed-RL) does not split the cluster into a generation half and
a training half: it time-shares all devices, generating on every device and then training on every
device. `colocate` derives that layout from a program: every pool merged into one pool of all the
devices, each generate stage (and any stage written with several instances, such as a judge)
re-spread over them at the same tp/pp/dp/cp/ep, every other stage on a pool data-parallel over them
at the same tp/pp/cp/ep; the passes then place the stages time-shared (`place`) and the controller
switches the pool between generation and the learner. `sync_baseline` is that layout under
`schedule sync`: the `sync@colocated` row of `aspc simulate --compare`.

Why here, in the front end, and not a pass: the transformation rewrites the AST, before checking.
So the derived program is ordinary .aspl text that `format_program` prints and a person can read,
save and compile, and the front end's checks — placements fit the pool, parallel layouts fit the
model, weights + KV / optimizer state fit a device — judge it exactly as they judge a file. A pass
works on the checked StageGraph after those checks, with pools fixed. The module keeps the front
end's import contract: it reads the resolved facts of the user's program (aspc.ir.graph) and uses
the front end's own compiler; it imports no pass, plan or backend.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from aspc.frontend import ast
from aspc.frontend.compiler import Compilation, compile_source
from aspc.frontend.diagnostics import AsplError, Diagnostic
from aspc.frontend.formatter import format_program
from aspc.ir.graph import Stage, StageGraph, StageKind
from aspc.ir.layout import Layout, StageLayout
from aspc.ir.span import Span

BASELINE_SOURCE = "<colocated>"  # the file name the derived program's diagnostics point into
POOL_NAME = "all"


class BaselineUnavailable(AsplError):
    """The colocated baseline cannot be derived or does not pass the checks; `sources` holds the
    derived text (under BASELINE_SOURCE) so that its diagnostics render with their lines."""

    def __init__(self, diagnostics, sources: dict[str, str] | None = None):
        super().__init__(diagnostics)
        self.sources = sources or {}


def compile_baseline(compilation: Compilation, base_dir: Path | None) -> Compilation:
    """The user's (checked) program as the sync baseline colocated on all devices, compiled;
    raises BaselineUnavailable with located diagnostics when it cannot be had."""
    text = format_program(sync_baseline(compilation.program, compilation.graph))
    try:
        return compile_source(text, BASELINE_SOURCE, None, base_dir)
    except AsplError as error:
        lead = Diagnostic("error", Span.point(BASELINE_SOURCE),
                          "the colocated layout of this program does not pass the checks (below)",
                          "the sync@colocated baseline is not available for it")
        raise BaselineUnavailable((lead, *error.diagnostics), {BASELINE_SOURCE: text}) from None


def sync_baseline(program: ast.Program, graph: StageGraph) -> ast.Program:
    """`colocate(program)` under `schedule sync` (with its defaults)."""
    colocated = colocate(program, graph)
    decls = [d for d in colocated.decls if not isinstance(d, ast.Schedule)]
    return replace(colocated, decls=(*decls, ast.Schedule("sync", ())))


def colocate(program: ast.Program, graph: StageGraph) -> ast.Program:
    """The same pipeline on one pool of all the devices, time-shared; `graph` is the program's
    checked stage graph (resolved pools, parallel degrees and data)."""
    pools = [d for d in program.decls if isinstance(d, ast.Pool)]
    _require_one_hardware(pools)
    devices = sum(graph.pools[p.name].count for p in pools)
    name = pools[0].name if len(pools) == 1 else _free_name(program)
    merged = ast.Pool(name, pools[0].hardware, ast.Int(devices))
    cap = max((d.prompts_per_step * d.group for d in graph.data.values()), default=devices)
    decls = []
    for decl in program.decls:
        if isinstance(decl, ast.Pool):
            decls += [merged] if decl is pools[0] else []
        elif isinstance(decl, ast.Stage) and graph.stage(decl.name).pool is not None:
            decls.append(_respread(decl, graph.stage(decl.name), name, devices, cap))
        else:
            decls.append(decl)
    return replace(program, decls=tuple(decls), comments=())  # the file's comments describe its own layout


def _require_one_hardware(pools: list[ast.Pool]) -> None:
    if not pools:
        raise BaselineUnavailable([Diagnostic("error", Span.point(BASELINE_SOURCE), "the program declares no pool",
                                              "a colocated baseline needs devices to time-share")])
    first = pools[0]
    for pool in pools[1:]:
        if pool.hardware != first.hardware:
            raise BaselineUnavailable([Diagnostic(
                "error", pool.hardware_span or pool.span,
                f"cannot colocate on all devices: pool '{pool.name}' is {pool.hardware}, "
                f"pool '{first.name}' is {first.hardware}",
                "the colocated baseline time-shares one pool of every device, so all pools must be one "
                "kind of device",
                notes=[(first.hardware_span or first.span, f"pool '{first.name}' is declared here")])])


def _free_name(program: ast.Program) -> str:
    """POOL_NAME, or POOL_NAME_2, ... when a declaration of the program already has that name."""
    taken = {getattr(d, "name", None) for d in program.decls if not isinstance(d, ast.Schedule)}
    name, k = POOL_NAME, 1
    while name in taken:
        k += 1
        name = f"{POOL_NAME}_{k}"
    return name


def _respread(decl: ast.Stage, stage: Stage, pool: str, devices: int, cap: int) -> ast.Stage:
    """The stage on the merged pool: instances re-spread (generation, several-instance stages) or
    data parallelism over all devices (train, reference, critic, a reward model)."""
    p = stage.parallel
    if stage.kind is StageKind.GENERATE or stage.instances > 1:
        instances = max(1, min(devices // p.devices, cap))
        options = _with_option(decl.options, "instances", instances)
    else:
        options = _with_option(decl.options, "dp", _data_parallel(stage, devices))
    return replace(decl, pool=ast.Name(pool), options=options)


def _data_parallel(stage: Stage, devices: int) -> int:
    """The largest dp that fits the devices at the stage's tp x pp x cp and that ep divides
    (ep must divide dp x cp on a learner-side stage)."""
    p = stage.parallel
    dp = max(1, devices // (p.tp * p.pp * p.cp))
    while dp > 1 and (dp * p.cp) % p.ep:
        dp -= 1
    return dp


def _with_option(options: tuple[ast.Option, ...], name: str, value: int) -> tuple[ast.Option, ...]:
    """`name = value` in place of the written option, or first in the block (written only when it
    differs from the default of 1)."""
    if any(o.name == name for o in options):
        return tuple(replace(o, value=ast.Int(value)) if o.name == name else o for o in options)
    return options if value == 1 else (ast.Option(name, ast.Int(value)), *options)


# ---- a chosen layout written back as source (`aspc tune`, `simulate --best-layout`) ----
LAYOUT_OPTIONS = ("instances", "tp", "pp", "dp", "cp", "ep")


def apply_layout(program: ast.Program, layout: Layout, schedule: ast.Schedule | None = None) -> ast.Program:
    """The program with the layout's pool sizes (a pool the layout drops removed, a new one added
    after the last pool), each placed stage on its pool at its instances and parallel degrees, and
    `schedule` (default: the program's, without `placement = auto`, since the layout is now written)."""
    sizes = dict(layout.pools)
    pools = [d for d in program.decls if isinstance(d, ast.Pool)]
    moved = {s.stage for s in layout.stages}
    used = {d.pool.name for d in program.decls if isinstance(d, ast.Stage) and d.pool and d.name not in moved}
    added = [ast.Pool(name, pools[0].hardware, ast.Int(n)) for name, n in layout.pools
             if name not in {p.name for p in pools}]
    decls = []
    for decl in program.decls:
        if isinstance(decl, ast.Pool):
            if decl.name in sizes:
                decls.append(replace(decl, count=ast.Int(sizes[decl.name])))
            elif decl.name in used:
                decls.append(decl)
            if decl is pools[-1]:
                decls += added
        elif isinstance(decl, ast.Stage) and layout.stage(decl.name) is not None:
            decls.append(_placed(decl, layout.stage(decl.name)))
        elif isinstance(decl, ast.Schedule):
            decls.append(schedule or _written_placement(decl))
        else:
            decls.append(decl)
    if schedule is not None and not any(isinstance(d, ast.Schedule) for d in decls):
        decls.append(schedule)
    return replace(program, decls=tuple(decls))


def _placed(decl: ast.Stage, placed: StageLayout) -> ast.Stage:
    options = decl.options
    values = {"instances": placed.instances, **{k: getattr(placed.parallel, k) for k in LAYOUT_OPTIONS[1:]}}
    for name in reversed(LAYOUT_OPTIONS):
        options = _with_option(options, name, values[name])
    return replace(decl, pool=ast.Name(placed.pool), options=options)


def _written_placement(decl: ast.Schedule) -> ast.Schedule:
    return replace(decl, options=tuple(o for o in decl.options if o.name != "placement"))
