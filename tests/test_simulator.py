"""Simulator behaviour: accounting, the schedules' ordering, scaling, and the long tail."""
import json

import pytest

from aspc.accounting.ledger import CATEGORIES
from aspc.backends.sim.pricing import RooflinePricing
from aspc.drivers.sim.result import simulate
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT


def run(name, schedule, steps=4, overrides=()):
    plan = compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", list(overrides), schedule).plan()
    return simulate(plan, steps, RooflinePricing(plan))


@pytest.mark.parametrize("name", ["tiny_grpo", "tiny_ppo", "grpo_7b", "dapo_32b", "grpo_30b_moe"])
@pytest.mark.parametrize("schedule", ["sync-naive", "sync", "asp"])
def test_bubbles_sum_to_device_time(name, schedule):
    r = run(name, schedule, steps=2)
    total = r.devices * r.wall_s
    assert set(r.bubbles) == set(CATEGORIES)
    assert sum(r.bubbles.values()) == pytest.approx(total, rel=1e-9)
    assert sum(v for k, v in r.bubbles.items() if k != "idle") <= total * (1 + 1e-9)
    assert all(v >= 0 for v in r.bubbles.values())
    assert 0 < r.efficiency <= 1


def test_asp_with_staleness_zero_trains_the_sync_samples_on_policy():
    asp = run("grpo_7b", "asp", overrides=["schedule.staleness=0"])
    sync = run("grpo_7b", "sync")
    assert asp.staleness == sync.staleness == {0: 4 * 256}
    assert (asp.mean_prompt, asp.mean_response) == (sync.mean_prompt, sync.mean_response)


def test_on_a_long_tail_asp_beats_sync_beats_sync_naive():
    naive, sync, asp = (run("grpo_7b", s) for s in ("sync-naive", "sync", "asp"))
    assert asp.e2e_tps > sync.e2e_tps > naive.e2e_tps
    assert naive.bubbles["padding"] > sync.bubbles["padding"]


@pytest.mark.parametrize("schedule", ["sync-naive", "sync", "asp"])
def test_more_devices_never_make_a_step_slower(schedule):
    """Both pools grow: more generation instances, more data-parallel training ranks."""
    times = []
    for k in (1, 2, 4):
        r = run("grpo_7b", schedule, overrides=[f"rollout.count={4 * k}", f"gen.instances={k}",
                                                 f"learner.count={4 * k}", f"update.dp={k}", f"ref_lp.dp={k}"])
        times.append(r.step_time)
    assert times[0] >= times[1] >= times[2]


def test_a_longer_tail_increases_asps_advantage():
    def speedup(sigma):
        tail = [f"prompts.response_lengths=lognormal(mean = 600, sigma = {sigma}, group_corr = 0.6)"]
        return run("grpo_7b", "asp", overrides=tail).e2e_tps / run("grpo_7b", "sync", overrides=tail).e2e_tps

    assert speedup(1.2) > speedup(0.3)


def test_simulate_command_compare_trace_and_plot(aspc, tmp_path):
    trace, plot = tmp_path / "t.json", tmp_path / "p.png"
    result = aspc("simulate", "pipelines/grpo_7b.aspl", "--compare", "--steps", "3",
                  "--trace", str(trace), "--plot", str(plot))
    assert result.exit_code == 0, result.output
    for schedule in ("| sync-naive |", "| sync |", "| asp |"):
        assert schedule in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert spans and {names[e["pid"]] for e in spans} == {"sync-naive", "sync", "asp"}
    assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in events)
    assert all(e["dur"] >= 0 and e["cat"] in CATEGORIES for e in spans)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_simulate_single_schedule_summary(aspc):
    result = aspc("simulate", "pipelines/tiny_ppo.aspl", "--steps", "2", "--schedule", "sync")
    assert result.exit_code == 0, result.output
    assert "schedule sync" in result.stdout and "e2e_tps" in result.stdout and "bubbles" in result.stdout


def test_decode_step_matches_the_published_single_stream_speed():
    """shared/FACTS.md: Qwen2.5-7B on a 910B2 decodes one stream at about 12 ms per token."""
    from aspc.costmodel.roofline import GenerationCost
    from aspc.ir.facts import hardware_table, model_presets
    from aspc.ir.graph import Parallel

    cost = GenerationCost(model_presets()["qwen2.5-7b"], hardware_table()["910b2"], Parallel(), 2, True)
    step = cost.alpha * 2000 + cost.beta(1)
    assert 0.010 < step < 0.015


def test_the_simulator_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, aspc.drivers.sim.result, aspc.cli.main; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def _grpo_7b_source() -> str:
    return (ROOT / "pipelines" / "grpo_7b.aspl").read_text().replace('jsonl("data/math.jsonl")', 'synthetic("arith")')


def _with_reward_model(source: str, instances: int = 1) -> str:
    return source.replace("pool learner = 910b3 x 8", "pool learner = 910b3 x 8\npool judges = 910b3 x 8").replace(
        "model ref = frozen(actor)", "model ref = frozen(actor)\nmodel rm = qwen2.5-7b").replace(
        'reward(gen, rule = "math_verify")', f"reward(gen, model = rm) on judges {{ tp = 4, instances = {instances} }}")


def test_a_reward_model_is_priced_on_its_own_pool(tmp_path):
    """The reward model's scoring runs on its pool and shows in the ledger; it cannot make the
    step faster than a rule reward (it adds a forward pass between generation and training)."""
    plans = {}
    for name, text in (("rule", _grpo_7b_source()), ("rm", _with_reward_model(_grpo_7b_source(), 2))):
        (tmp_path / f"{name}.aspl").write_text(text)
        plans[name] = compile_with_passes(tmp_path / f"{name}.aspl", [], "asp").plan()
    rule, rm = (simulate(plans[n], 3, RooflinePricing(plans[n])) for n in ("rule", "rm"))
    assert rm.devices == rule.devices + 8
    assert rm.step_time >= rule.step_time
    scoring = [s for s in rm.spans if s.track.startswith("judges") and s.label.startswith("reward step")]
    assert {s.track for s in scoring} == {"judges[0]", "judges[1]"}  # both instances score units
    assert sum(s.end - s.start for s in scoring) > 0
    assert not any(s.track.startswith("judges") for s in rule.spans)


def _with_judge(source: str, instances: int = 1, model: str = "qwen2.5-7b") -> str:
    return _with_reward_model(source, instances).replace("model rm = qwen2.5-7b", f"model rm = {model}").replace(
        "reward(gen, model = rm)",
        'reward(gen, sources = [judge(model = rm, prompt = "Grade the answer."), rule("math_verify", weight = 0.2)])')


def _plans(tmp_path, schedule="asp", **sources):
    tmp_path.mkdir(exist_ok=True)
    plans = {}
    for name, text in sources.items():
        (tmp_path / f"{name}.aspl").write_text(text)
        plans[name] = compile_with_passes(tmp_path / f"{name}.aspl", [], schedule).plan()
    return plans


def test_a_judge_is_priced_on_its_own_pool(tmp_path):
    """An LLM judge's verdicts run on its pool's instances and show in the ledger and the pool
    shares; they cannot make the step faster than the rule reward alone (they add a prefill and a
    decode between generation and training)."""
    plans = _plans(tmp_path, rule=_grpo_7b_source(), judge=_with_judge(_grpo_7b_source(), 2))
    rule, judge = (simulate(plans[n], 3, RooflinePricing(plans[n])) for n in ("rule", "judge"))
    assert judge.devices == rule.devices + 8
    assert judge.step_time >= rule.step_time
    judging = [s for s in judge.spans if s.track.startswith("judges") and s.label.startswith("reward step")]
    assert {s.track for s in judging} == {"judges[0]", "judges[1]"}
    assert sum(s.end - s.start for s in judging) > 0
    assert 0 < judge.pool_share("judges") < 1 and "judges" not in rule.pools
    assert sum(judge.pool_share(p) for p in judge.pools) == pytest.approx(1)
    total = judge.devices * judge.wall_s
    assert sum(judge.bubbles.values()) == pytest.approx(total, rel=1e-9)


def test_a_judge_pays_its_prefill_and_each_verdict_token_a_reward_model_a_forward_pass(tmp_path, monkeypatch):
    """Same 7B model, same pool and layout: the reward model reads each sequence once (a forward
    pass); the judge prefills rubric, prompt and response, then decodes its verdict token(s): a
    longer verdict costs more, none at all leaves a prefill that is cheaper than the reward model's
    forward (which also reads no rubric)."""
    import aspc.backends.sim.pricing as pricing
    from aspc.controller.events import Work

    plans = _plans(tmp_path, rm=_with_reward_model(_grpo_7b_source()), judge=_with_judge(_grpo_7b_source()))
    lengths = [900 + 37 * i for i in range(16)]
    work = Work(0, "score", "reward", 0, tuple((0, i // 8, i % 8) for i in range(16)))

    def seconds(name):
        plan = plans[name]
        return RooflinePricing(plan).work(work, plan.stage("score"), lengths)

    rm, judge = seconds("rm"), seconds("judge")
    assert judge.useful + judge.padding + judge.tail == pytest.approx(judge.seconds * 4)  # one tp=4 instance
    rm_sim, judge_sim = (simulate(plans[n], 2, RooflinePricing(plans[n])) for n in ("rm", "judge"))
    busy = {name: sum(s.end - s.start for s in r.spans if s.track.startswith("judges"))
            for name, r in (("rm", rm_sim), ("judge", judge_sim))}
    assert busy["judge"] > 0 and busy["rm"] > 0
    monkeypatch.setattr(pricing, "JUDGE_VERDICT_TOKENS", 0)  # without the verdict: a prefill only
    prefill_only = seconds("judge")
    monkeypatch.setattr(pricing, "JUDGE_VERDICT_TOKENS", 64)  # a verdict with a reason
    reasoned = seconds("judge")
    assert prefill_only.seconds < rm.seconds
    assert prefill_only.seconds < judge.seconds < reasoned.seconds


def test_a_judge_pads_only_under_static_batching(tmp_path):
    """sync-naive (no continuous batching) pads each wave's prompts to its longest: padding; sync
    batches them as they are: all useful."""
    lengths = [400 + 97 * i for i in range(16)]
    costs = {}
    for schedule in ("sync-naive", "sync"):
        plan = _plans(tmp_path / schedule, schedule, judge=_with_judge(_grpo_7b_source()))["judge"]
        costs[schedule] = RooflinePricing(plan).judge(plan.stage("score"), "rm", "Grade it.", lengths)
    assert costs["sync"].padding == 0 and costs["sync-naive"].padding > 0
    assert costs["sync-naive"].useful == pytest.approx(costs["sync"].useful)


def test_a_judge_bounded_by_kv_room_judges_in_waves(tmp_path):
    """A unit of more samples than the judge instance holds runs in waves of what it holds: two
    full waves cost twice one, and one sample past a full wave pays a whole verdict decode."""
    from aspc.backends.sim.pricing import JUDGE_VERDICT_TOKENS

    plan = _plans(tmp_path, judge=_with_judge(_grpo_7b_source()))["judge"]
    pricing = RooflinePricing(plan)
    stage = plan.stage("score")
    engine, room = pricing.judge_engine(stage, "rm", 1000 + JUDGE_VERDICT_TOKENS)
    assert 1 < room < 4096

    def judged(n):
        return pricing.judge(stage, "rm", "", [1000] * n).seconds

    assert judged(2 * room) == pytest.approx(2 * judged(room))
    assert judged(room + 1) - judged(room) > JUDGE_VERDICT_TOKENS * engine.beta(1)


def test_a_judges_concurrency_caps_the_verdicts_priced_at_once(tmp_path):
    """`concurrency` calls in flight: a unit of 4 x 8 samples with concurrency 8 costs four waves of 8."""
    plan = _plans(tmp_path, judge=_with_judge(_grpo_7b_source()))["judge"]
    pricing, stage = RooflinePricing(plan), plan.stage("score")

    def judged(n, concurrency=None):
        return pricing.judge(stage, "rm", "", [1000] * n, concurrency).seconds

    assert judged(32, concurrency=8) == pytest.approx(4 * judged(8))
    assert judged(32, concurrency=8) > judged(32) and judged(32, concurrency=10_000) == judged(32)


def _on_learner(source: str, pool: str, layout: str) -> str:
    return source.replace("model ref = frozen(actor)", "model ref = frozen(actor)\nmodel rm = qwen2.5-7b").replace(
        'reward(gen, rule = "math_verify")', f"reward(gen, model = rm) on {pool} {{ {layout} }}")


def test_a_reward_model_on_the_learner_pool_serializes_with_training(tmp_path):
    """Colocated with the trainer, the reward model's units run on the trainer's executor, one item
    at a time: its spans are on the learner track, never overlapping training there."""
    plans = _plans(tmp_path, rule=_grpo_7b_source(), rm=_on_learner(_grpo_7b_source(), "learner", "tp = 4, dp = 2"))
    rule, rm = (simulate(plans[n], 3, RooflinePricing(plans[n])) for n in ("rule", "rm"))
    assert rm.devices == rule.devices and set(rm.pools) == {"rollout", "learner"}
    scoring = [s for s in rm.spans if s.label.startswith("reward step")]
    assert scoring and {s.track for s in scoring} == {"learner"}
    learner = sorted((s.start, s.end) for s in rm.spans if s.track == "learner" and s.category == "useful")
    assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(learner, learner[1:]))
    assert rm.step_time >= rule.step_time
    assert rm.pool_share("learner") > rule.pool_share("learner")


def test_a_reward_model_on_a_time_shared_pool_waits_for_the_switch(tmp_path):
    """On grpo_7b_colocated the reward model shares the pool generation time-shares with the
    trainer: it scores only after the controller hands the pool to the learner (SwitchPool)."""
    from aspc.drivers.sim.driver import Simulation

    text = (ROOT / "pipelines" / "grpo_7b_colocated.aspl").read_text().replace(
        'jsonl("data/math.jsonl")', 'synthetic("arith")')
    plan = _plans(tmp_path, rm=_on_learner(text, "npu", "tp = 4, dp = 4"))["rm"]
    sim = Simulation(plan, 2, RooflinePricing(plan))
    sim.run()
    scoring = [s for s in sim.ledger.spans if s.label.startswith("reward step")]
    assert scoring and {s.track for s in scoring} == {"npu"}
    marks = sim.modes["npu"] + [(sim.now, "end")]
    learning = [(a, b) for (a, mode), (b, _) in zip(marks, marks[1:]) if mode == "learn"]
    assert learning and all(any(a <= s.start and s.end <= b + 1e-9 for a, b in learning) for s in scoring)


def test_a_judge_is_no_longer_refused_and_prints_its_pools_share(aspc, tmp_path):
    path = tmp_path / "judge.aspl"
    path.write_text(_with_judge(_grpo_7b_source()))
    result = aspc("simulate", str(path), "--steps", "1", "--schedule", "sync")
    assert result.exit_code == 0, result.output
    pools = next(line for line in result.stdout.splitlines() if line.strip().startswith("pools"))
    assert "judges 8 dev" in pools and "rollout 8 dev" in pools and "learner 8 dev" in pools
    result = aspc("simulate", str(path), "--steps", "1", "--compare")
    assert result.exit_code == 0, result.output
    assert "busy device-time by pool" in result.stdout and result.stdout.count("judges 8 dev") == 3


def test_an_environment_stage_is_priced_not_free(aspc, tmp_path):
    """Once refused (it would have been free); now its episodes are priced: turns, tool waits and
    observations make the step longer than the single-turn plan (tests/test_sim_episodes.py)."""
    source = _grpo_7b_source()
    env = source.replace('stage score  = reward(gen, rule = "math_verify")',
                         'stage env = environment(gen) { tools = [tool("calc", python = "tools:calc")], '
                         'max_turns = 3 }\n'
                         'stage score  = reward(env, rule = "math_verify")').replace(
        "train(actor, gen, ref_lp, adv)", "train(actor, env, ref_lp, adv)")
    (tmp_path / "tools.py").write_text("def calc(expression: str) -> str:\n    return expression\n")
    plans = _plans(tmp_path, rule=source, env=env)
    rule, agentic = (simulate(plans[n], 1, RooflinePricing(plans[n])) for n in ("rule", "env"))
    assert agentic.step_time > rule.step_time and agentic.tool_calls > 0
    result = aspc("simulate", str(tmp_path / "env.aspl"), "--steps", "1")
    assert result.exit_code == 0, result.output
    assert "tool_wait" in result.stdout and "Traceback" not in result.output
