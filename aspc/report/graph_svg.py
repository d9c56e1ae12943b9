"""The schedule graph as inline SVG, laid out here (Graphviz is not on every machine): a band per
pool (its cluster) plus one for host-side stages, stages in columns by dataflow depth, each with
its instances x tp/pp/dp/ep; weight edges dashed. Hovering a stage shows all its pass results."""
from __future__ import annotations

import math
from html import escape

from aspc.ir.graph import WEIGHTS, Stage, StageGraph
from aspc.report.decisions import phrase, words

# as in aspc/ir/dot.py
FILL = {"GENERATE": "#cfe8ff", "ENVIRONMENT": "#e0d4ff", "REWARD": "#fff2b3", "REFERENCE": "#e5e5e5",
        "CRITIC": "#ffd9b3", "ADVANTAGE": "#fce0ec", "TRAIN": "#c9f2c9", "CHANNEL": "#ffffff",
        "DISPATCH": "#ffffff", "WEIGHT_SYNC": "#ffffff"}
NODE_W, NODE_H, COL_GAP, ROW_GAP, LABEL_H, PAD, BAND_GAP = 190, 70, 52, 12, 20, 10, 14
HOST = "host (no devices)"
CHAR_W, NAME_CHAR_W, EDGE_CHAR_W, TEXT_H = 6.8, 7.6, 6.2, 12  # upper bounds of the fonts of page.css
Box = tuple[float, float, float, float]  # left, top, right, bottom


def graph_svg(graph: StageGraph, schedule: str) -> str:
    layer = _layers(graph)
    where, bands = _place(graph, layer)
    arrow = f"arrow-{escape(schedule)}"  # one id per picture: a hidden picture's marker draws nowhere
    edges = [_edge(flow, where, arrow) for flow in graph.flows()]
    nodes = [_node(stage, graph, *where[stage.name]) for stage in graph.stages()]
    left, top, width, height = _extent([box for _, box in edges + nodes] + [_band_box(band) for band in bands])
    return (f'<svg class="schedule-graph" data-schedule="{escape(schedule)}" xmlns="http://www.w3.org/2000/svg" '
            f'viewBox="{left} {top} {width} {height}" width="{width}" height="{height}" role="img" '
            f'aria-label="schedule graph of {escape(graph.pipeline)} under {escape(schedule)}">'
            f'<defs><marker id="{arrow}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
            'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"/></marker></defs>'
            + "".join(_band(band, left + width) for band in bands)
            + "".join(svg for svg, _ in edges + nodes) + "</svg>")


def _place(graph: StageGraph, layer: dict[str, int]):
    """Each stage's top-left corner, and each band as (label, top, height)."""
    where, bands, y = {}, [], 0
    for label, stages in _bands(graph):
        bands.append((label, y, _band_height(stages, layer)))
        slot: dict[int, int] = {}
        for stage in stages:
            row = slot[layer[stage.name]] = slot.get(layer[stage.name], -1) + 1
            where[stage.name] = (PAD + layer[stage.name] * (NODE_W + COL_GAP), y + LABEL_H + row * (NODE_H + ROW_GAP))
        y += bands[-1][2] + BAND_GAP
    return where, bands


def _band(band: tuple[str, int, int], right: int) -> str:
    """A band is as wide as the picture: it encloses every column."""
    label, top, height = band
    return (f'<g class="pool"><rect x="1" y="{top}" width="{right - 2}" height="{height}" rx="6"/>'
            f'<text x="{PAD}" y="{top + 14}">{escape(label)}</text></g>')


def _band_box(band: tuple[str, int, int]) -> Box:
    label, top, height = band
    return _union([(0, top, 0, top + height), _text_box(label, PAD, top + 14, NAME_CHAR_W)])


def _extent(boxes: list[Box]) -> tuple[int, int, int, int]:
    """The view box (left, top, width, height): everything drawn, and a margin on the right and below."""
    left, top, right, bottom = _union([(0, 0, 0, 0), *boxes])
    return math.floor(left), math.floor(top), math.ceil(right - left + PAD), math.ceil(bottom - top + PAD)


def _text_box(text: str, x: float, baseline: float, char_w: float, anchor_middle: bool = False) -> Box:
    """A generous estimate of a line's box: no fonts are measured here."""
    w = len(text) * char_w
    left = x - w / 2 if anchor_middle else x
    return (left, baseline - TEXT_H, left + w, baseline + 3)


def _is_weights(flow) -> bool:
    return flow.fields == (WEIGHTS,)


def _layers(graph: StageGraph) -> dict[str, int]:
    """Longest dataflow path to each stage; a stage joined only by weight edges (WEIGHT_SYNC)
    sits in the column of the stage it loads weights into."""
    layer: dict[str, int] = {}
    for stage in graph.stages():
        inputs = [f.src for f in graph.flows() if f.dst == stage.name and not _is_weights(f)]
        layer[stage.name] = max((layer.get(src, 0) + 1 for src in inputs), default=0)
    for stage in graph.stages():
        flows = [f for f in graph.flows() if stage.name in (f.src, f.dst)]
        if flows and all(_is_weights(f) for f in flows):
            targets = [layer[f.dst] for f in flows if f.src == stage.name]
            layer[stage.name] = min(targets, default=layer[stage.name])
    return layer


def _bands(graph: StageGraph) -> list[tuple[str, list[Stage]]]:
    out = []
    for name, pool in graph.pools.items():
        stages = [s for s in graph.stages() if s.pool == name]
        if stages:
            out.append((f"pool {name}: {pool.hardware.name} x {pool.count}", stages))
    host = [s for s in graph.stages() if s.pool is None]
    return out + ([(HOST, host)] if host else [])


def _band_height(stages: list[Stage], layer: dict[str, int]) -> int:
    per_column: dict[int, int] = {}
    for stage in stages:
        per_column[layer[stage.name]] = per_column.get(layer[stage.name], 0) + 1
    rows = max(per_column.values())
    return LABEL_H + rows * NODE_H + (rows - 1) * ROW_GAP + PAD


def _edge(flow, where, arrow: str) -> tuple[str, Box]:
    (x1, y1), (x2, y2) = where[flow.src], where[flow.dst]
    label = escape(", ".join(flow.fields))
    if x2 > x1:  # forward: right side to left side
        a, b = (x1 + NODE_W, y1 + NODE_H / 2), (x2, y2 + NODE_H / 2)
        bend = (b[0] - a[0]) / 2
        path = f"M{a[0]},{a[1]} C{a[0] + bend},{a[1]} {b[0] - bend},{b[1]} {b[0]},{b[1]}"
    else:  # back or in one column: below, bottom to bottom
        a, b = (x1 + NODE_W / 2, y1 + NODE_H), (x2 + NODE_W / 2 + 12, y2 + NODE_H)
        dip = max(a[1], b[1]) + 28
        path = f"M{a[0]},{a[1]} C{a[0]},{dip} {b[0]},{dip} {b[0]},{b[1]}"
    mid = ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + (0 if x2 > x1 else 24))
    kind = "edge weights" if _is_weights(flow) else "edge"
    svg = (f'<g class="{kind}"><path d="{path}" marker-end="url(#{arrow})"/>'
           f'<text x="{mid[0]:.0f}" y="{mid[1] - 4:.0f}">{label}</text></g>')
    return svg, _union([_points_box(path), _text_box(", ".join(flow.fields), mid[0], mid[1] - 4, EDGE_CHAR_W, True)])


def _points_box(path: str) -> Box:
    """A Bezier curve lies within its control points: their box holds the curve."""
    xs, ys = zip(*(map(float, p.split(",")) for p in path.replace("M", " ").replace("C", " ").split()))
    return (min(xs), min(ys), max(xs), max(ys))


def _union(boxes: list[Box]) -> Box:
    return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))


def _node(stage: Stage, graph: StageGraph, x: float, y: float) -> tuple[str, Box]:
    kind = stage.kind.name + (f"({stage.model})" if stage.model else "")
    texts = [kind, *_devices(stage, graph)]
    lines = [f'<tspan class="name" x="{x + 8}" dy="15">{escape(stage.name)}</tspan>',
             *(f'<tspan x="{x + 8}" dy="14">{escape(text)}</tspan>' for text in texts)]
    results = [phrase(record, stage) for _, record in stage.results()]
    tip = escape("\n".join([f"{stage.name} ({kind})", *_devices(stage, graph), *results]))
    svg = (f'<g class="node" data-stage="{escape(stage.name)}"><title>{tip}</title>'
           f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="8" fill="{FILL[stage.kind.name]}"/>'
           f'<text y="{y}">{"".join(lines)}</text></g>')
    boxes = [(x, y, x + NODE_W, y + NODE_H), _text_box(stage.name, x + 8, y + 15, NAME_CHAR_W)]
    boxes += [_text_box(text, x + 8, y + 29 + 14 * i, CHAR_W) for i, text in enumerate(texts)]
    return svg, _union(boxes)


def _devices(stage: Stage, graph: StageGraph) -> list[str]:
    """`8 x [tp4 pp1 dp1 ep1]`, `32 x 910b3`; a stage on no pool: what a pass decided there, or host."""
    if stage.pool is None:
        decided = [words(record, stage) for _, record in stage.results()]
        return [_short(decided[0]) if decided else "host"]
    p = stage.parallel
    degrees = f"tp{p.tp} pp{p.pp} dp{p.dp} ep{p.ep}" + (f" cp{p.cp}" if p.cp > 1 else "")
    return [f"{stage.instances} x [{degrees}]", f"= {stage.devices} x {graph.pools[stage.pool].hardware.name}"]


def _short(text: str, width: int = 34) -> str:
    return text if len(text) <= width else text[:width - 1] + "\u2026"
