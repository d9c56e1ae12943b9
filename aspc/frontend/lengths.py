"""A data block's length distributions against its caps: `response_lengths` within max_response,
`prompt_lengths` within max_prompt, mixtures component by component and as a whole."""
from __future__ import annotations

from aspc.frontend import ast
from aspc.frontend.diagnostics import DiagnosticSink
from aspc.frontend.options import OptionValues, value_span
from aspc.ir.values import Call

CAPS = (("response_lengths", "max_response"), ("prompt_lengths", "max_prompt"))


def check_lengths(data: ast.Data, values: OptionValues, sink: DiagnosticSink) -> None:
    for option, cap_name in CAPS:
        dist, cap = values[option], values[cap_name]
        if dist is None:
            continue
        if dist.func != "mixture":
            _check_single(dist, values.value_spans[option], f"{option} = {dist}", cap_name, cap, sink)
            continue
        written = _written(data, option)
        fits = [_check_component(c, arg, option, cap_name, cap, sink)
                for c, arg in zip(dist.get("components"), written.args)]
        if all(fits):  # else the component is the error to fix first
            _check_mixture_mean(dist, values.value_spans[option], option, cap_name, cap, sink)
        if option == "prompt_lengths":
            _warn_per_on_prompts(written, sink)


def nominal_mean(dist: Call) -> float:
    """The mean a distribution is written with (before the cap truncates it)."""
    if dist.func == "fixed":
        return dist.get("length")
    if dist.func == "uniform":
        return (dist.get("min") + dist.get("max")) / 2
    if dist.func == "mixture":
        weights = dist.get("weights")
        return sum(w * nominal_mean(c) for w, c in zip(weights, dist.get("components"))) / sum(weights)
    return dist.get("mean")


def _check_single(dist: Call, span, what: str, cap_name: str, cap: int, sink: DiagnosticSink) -> None:
    """Alone, a distribution's mean (a lognormal's) or its largest value must fit the cap."""
    high = dist.get("max") or nominal_mean(dist)
    if high > cap or (dist.func == "uniform" and dist.get("min") > dist.get("max")):
        sink.error(span, f"{what} does not fit 1 .. {cap_name} = {cap}")


def _check_component(dist: Call, arg: ast.Value, option: str, cap_name: str, cap: int,
                     sink: DiagnosticSink) -> bool:
    """In a mixture, a lognormal's mean may pass the cap (most of it is then cut off at the cap;
    the mixture's mean is checked); a fixed or uniform length beyond the cap can never be drawn."""
    if dist.func == "lognormal":
        return True
    if dist.func == "uniform" and dist.get("min") > dist.get("max"):
        sink.error(value_span(arg), f"{option}: component {dist} has min > max", "swap them")
        return False
    if (dist.get("max") or dist.get("length")) > cap:
        sink.error(value_span(arg), f"{option}: component {dist} does not fit 1 .. {cap_name} = {cap}",
                   f"a share at the cap is fixed(length = {cap})")
        return False
    return True


def _check_mixture_mean(dist: Call, span, option: str, cap_name: str, cap: int, sink: DiagnosticSink) -> None:
    mean = nominal_mean(dist)
    if mean > cap:
        sink.error(span, f"{option}: the mixture's mean, {mean:g} tokens, exceeds {cap_name} = {cap}",
                   f"lower the long components' weights or means; a share at the cap is fixed(length = {cap})")


def _warn_per_on_prompts(written: ast.Call, sink: DiagnosticSink) -> None:
    per = next((o for o in written.kwargs if o.name == "per"), None)
    if per is not None:
        sink.warning(per.extent or per.span, "'per' has no effect in prompt_lengths: a prompt has one length, "
                     "drawn once for its whole group", "remove it (it matters in response_lengths)")


def _written(data: ast.Data, option: str) -> ast.Call:
    """The mixture(...) as written (after --set overrides), for the spans of its components."""
    return next(o.value for o in data.options if o.name == option)  # a second one is an error
