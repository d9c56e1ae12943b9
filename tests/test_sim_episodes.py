"""Agentic episodes in the simulator: turns, tool calls that hold their KV slot, the tool runners,
the tool_wait bubble and the tool spans of the trace (docs/simulator.md, "Agentic episodes")."""
import json

import pytest

from aspc.accounting.ledger import CATEGORIES
from aspc.backends.sim.pricing import RooflinePricing
from aspc.controller.episodes import ANSWER, TOOL_TIMEOUT, EpisodePolicy
from aspc.costmodel.workload import Environment, draw_episode, sample_step
from aspc.drivers.sim.episodes import plan_episode
from aspc.drivers.sim.result import simulate
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT

TOOL = 'tool("calc", command = "python3 -", timeout = {timeout}, latency = {latency})'


def _source(latency="fixed(length = 1)", timeout=60, turns="uniform(min = 1, max = 4)", workers=64,
            env=True, small=False) -> str:
    text = (ROOT / "pipelines" / "grpo_7b.aspl").read_text().replace('jsonl("data/math.jsonl")', 'synthetic("arith")')
    if small:  # one instance, four samples a step: every episode can wait at once
        text = text.replace("pool rollout = 910b3 x 8", "pool rollout = 910b3 x 4").replace(
            "instances = 2, tp = 4", "instances = 1, tp = 4").replace(
            "prompts_per_step = 32, group = 8", "prompts_per_step = 2, group = 2")
    if not env:
        return text
    tool = TOOL.format(timeout=timeout, latency=latency)
    return text.replace(
        'stage score  = reward(gen, rule = "math_verify")',
        f"stage env = environment(gen) {{ tools = [{tool}], max_turns = 4, tool_workers = {workers}, "
        f"turns = {turns}, observation_tokens = fixed(length = 64) }}\n"
        'stage score  = reward(env, rule = "math_verify")').replace(
        "train(actor, gen, ref_lp, adv)", "train(actor, env, ref_lp, adv)")


def _run(tmp_path, text, schedule="asp", steps=2, name="p"):
    path = tmp_path / f"{name}.aspl"
    path.write_text(text)
    plan = compile_with_passes(path, [], schedule).plan()
    return simulate(plan, steps, RooflinePricing(plan))


def test_a_long_tool_latency_makes_a_step_longer(tmp_path):
    short = _run(tmp_path, _source(latency="fixed(length = 1)"), name="short")
    long = _run(tmp_path, _source(latency="fixed(length = 20)"), name="long")
    assert short.tool_calls == long.tool_calls > 0
    assert long.step_time > short.step_time
    assert long.bubbles["tool_wait"] > short.bubbles["tool_wait"]


def test_tool_wait_is_positive_when_every_episode_waits_and_zero_without_an_environment(tmp_path):
    waiting = _run(tmp_path, _source(latency="fixed(length = 30)", small=True), name="waiting")
    plain = _run(tmp_path, _source(env=False, small=True), name="plain")
    assert waiting.share("tool_wait") > 0.1
    assert plain.bubbles["tool_wait"] == 0 and plain.tool_calls == 0


def test_one_tool_runner_makes_tool_waits_longer_than_sixty_four(tmp_path):
    one = _run(tmp_path, _source(latency="fixed(length = 2)", workers=1), name="one")
    many = _run(tmp_path, _source(latency="fixed(length = 2)", workers=64), name="many")
    assert one.tool_calls == many.tool_calls > 0
    assert one.bubbles["tool_wait"] > many.bubbles["tool_wait"]
    assert one.step_time > many.step_time


@pytest.mark.parametrize("schedule", ["sync-naive", "sync", "asp"])
def test_one_turn_episodes_price_like_the_single_turn_plan(tmp_path, schedule):
    single = _run(tmp_path, _source(turns="fixed(length = 1)"), schedule, name="single")
    plain = _run(tmp_path, _source(env=False), schedule, name="plain")
    assert single.tool_calls == 0
    assert single.step_time == pytest.approx(plain.step_time, rel=1e-12)
    assert single.bubbles == pytest.approx(plain.bubbles, rel=1e-9)


@pytest.mark.parametrize("schedule", ["sync-naive", "sync", "asp"])
@pytest.mark.parametrize("small", [False, True])
def test_the_ledger_still_sums_to_device_time(tmp_path, schedule, small):
    r = _run(tmp_path, _source(latency="lognormal(mean = 5, sigma = 1)", timeout=8, small=small), schedule)
    total = r.devices * r.wall_s
    assert set(r.bubbles) == set(CATEGORIES)
    assert sum(r.bubbles.values()) == pytest.approx(total, rel=1e-9)
    assert all(v >= 0 for v in r.bubbles.values())
    assert 0 < r.efficiency <= 1
    assert sum(r.endings.values()) == r.samples_per_step * r.steps
    assert r.endings.get(TOOL_TIMEOUT, 0) > 0  # mean 5 s, timeout 8 s: some calls time out


def test_the_trace_has_tool_spans(aspc, tmp_path):
    path, trace = tmp_path / "env.aspl", tmp_path / "t.json"
    path.write_text(_source())
    result = aspc("simulate", str(path), "--steps", "2", "--trace", str(trace))
    assert result.exit_code == 0, result.output
    assert "tool_wait" in result.stdout and "tool calls/step" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    tools = [e for e in events if e["ph"] == "X" and e["cat"] == "tool"]
    assert tools and all(tracks[e["pid"], e["tid"]].startswith("tools[") for e in tools)
    assert all(e["dur"] > 0 and e["name"].startswith("calc") for e in tools)
    by_runner = {}
    for e in tools:  # one call at a time on a runner
        by_runner.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for calls in by_runner.values():
        calls.sort()
        assert all(end <= start + 1e-3 for (_, end), (start, _) in zip(calls, calls[1:]))


def test_episodes_split_the_drawn_response_and_end_where_the_policy_says(tmp_path):
    path = tmp_path / "env.aspl"
    path.write_text(_source(latency="lognormal(mean = 5, sigma = 1)", timeout=8))
    plan = compile_with_passes(path, [], "asp").plan()
    stage = plan.stages_of("environment")[0]
    env, policy = Environment.of(dict(stage.options)), EpisodePolicy.of(stage)
    data = plan.dataset(plan.stages_of("generate")[0].data)
    samples = sample_step(data, 0)
    for i, s in enumerate(samples):
        draw = draw_episode(env, data, 0, i // data.group, i % data.group, s.response_len)
        assert draw == draw_episode(env, data, 0, i // data.group, i % data.group, s.response_len)
        assert sum(draw.turns) == s.response_len and all(t >= 1 for t in draw.turns)
        assert 1 <= len(draw.turns) <= 4 and len(draw.latencies) == len(draw.turns) - 1
        episode = plan_episode(env, policy, draw)
        if episode.ended == ANSWER:
            assert episode.turns == draw.turns and len(episode.calls) == len(draw.turns) - 1
        else:
            assert episode.ended == TOOL_TIMEOUT and episode.ends_on_call
            assert episode.calls[-1].seconds == 8 and episode.calls[-1].observation == 0
