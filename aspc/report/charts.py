"""Line charts over training steps as inline SVG, for a measured run's metrics: a frame with ticks
and grid lines on both axes, the axes' titles, a dot per step when there are few, and a key when
there is more than one line."""
from __future__ import annotations

import math
from html import escape

W, H = 460, 250  # the chart's size in CSS pixels
LEFT, RIGHT, TOP, BOTTOM = 70, 14, 14, 44  # the plot's margins: tick labels and axis titles
DOTS_UP_TO = 60  # steps; more, and the dots would hide the line

Line = tuple[str, str, list[tuple[float, float]]]  # (colour, name, points)


def line_chart(title: str, y_title: str, lines: list[Line]) -> str:
    points = [p for _, _, line in lines for p in line]
    xs = _ticks(min(p[0] for p in points), max(p[0] for p in points), whole=True)
    ys = _ticks(min(p[1] for p in points), max(p[1] for p in points))
    at = _scale(xs, ys)
    body = _grid(xs, ys, at) + "".join(_polyline(color, line, at) for color, _, line in lines)
    return (f'<figure class="chart"><figcaption>{escape(title)}</figcaption>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
            f'aria-label="{escape(title)} over steps">{body}{_axis_titles(y_title)}</svg>{_key(lines)}</figure>')


def _ticks(lo: float, hi: float, whole: bool = False) -> list[float]:
    """4 to 10 round values from at or below lo to at or above hi; whole numbers for steps."""
    if hi == lo:
        lo, hi = lo - (0.5 if lo else 0), hi + (0.5 if hi else 1)
    step = _nice((hi - lo) / 5)
    if whole:
        step = max(1, round(step))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def _nice(raw: float) -> float:
    power = 10 ** math.floor(math.log10(raw))
    m = raw / power
    return power * (1 if m < 1.5 else 2 if m < 3.5 else 5 if m < 7.5 else 10)


def _scale(xs: list[float], ys: list[float]):
    def at(x: float, y: float) -> tuple[float, float]:
        px = LEFT + (x - xs[0]) / (xs[-1] - xs[0]) * (W - LEFT - RIGHT)
        py = H - BOTTOM - (y - ys[0]) / (ys[-1] - ys[0]) * (H - TOP - BOTTOM)
        return px, py
    return at


def _grid(xs: list[float], ys: list[float], at) -> str:
    out = [f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" class="plot"/>']
    for x in xs:
        px = at(x, ys[0])[0]
        out.append(f'<line class="grid" x1="{px:.1f}" y1="{TOP}" x2="{px:.1f}" y2="{H - BOTTOM}"/>'
                   f'<text class="tick x" x="{px:.1f}" y="{H - BOTTOM + 15}" text-anchor="middle">{x:g}</text>')
    for y in ys:
        py = at(xs[0], y)[1]
        out.append(f'<line class="grid" x1="{LEFT}" y1="{py:.1f}" x2="{W - RIGHT}" y2="{py:.1f}"/>'
                   f'<text class="tick y" x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{y:g}</text>')
    return "".join(out)


def _polyline(color: str, line: list[tuple[float, float]], at) -> str:
    points = [at(x, y) for x, y in line]
    out = (f'<polyline fill="none" stroke="{color}" stroke-width="2" '
           f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}"/>')
    if len(points) <= DOTS_UP_TO:
        out += "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in points)
    return out


def _axis_titles(y_title: str) -> str:
    middle = TOP + (H - TOP - BOTTOM) / 2
    return (f'<text class="axis-title x" x="{LEFT + (W - LEFT - RIGHT) / 2:.0f}" y="{H - 8}" '
            f'text-anchor="middle">step</text>'
            f'<text class="axis-title y" x="12" y="{middle:.0f}" text-anchor="middle" '
            f'transform="rotate(-90 12 {middle:.0f})">{escape(y_title)}</text>')


def _key(lines: list[Line]) -> str:
    if len(lines) < 2:
        return ""
    return '<div class="chart-key">' + "".join(
        f'<span class="key"><span class="swatch" style="background:{c}"></span>{escape(name)}</span>'
        for c, name, _ in lines) + "</div>"
