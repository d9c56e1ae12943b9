"""Property tests over randomly generated valid pipelines: every pass keeps the verifier's
invariants, the plan puts every instance on existing devices without over-subscribing any, and
channel capacities follow the staleness bound."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aspc.frontend.compiler import compile_source
from aspc.ir.graph import StageKind
from aspc.plan.execution_plan import PlanError, build_plan, plan_problems
from aspc.cli.toolchain import run_schedule
from aspc.ir.verify import verify_problems

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def pipelines(draw):
    group = draw(st.integers(2, 4))
    prompts = draw(st.integers(1, 6))
    gen = dict(instances=draw(st.integers(1, 3)), tp=draw(st.sampled_from([1, 2])))
    train = dict(tp=draw(st.sampled_from([1, 2])), dp=draw(st.sampled_from([1, 2])))
    with_ref = draw(st.booleans())
    ppo = draw(st.booleans())
    reward_instances = draw(st.integers(1, 2))
    split = draw(st.booleans())
    gen_devices = gen["instances"] * gen["tp"]
    learner_devices = train["tp"] * train["dp"]
    extra = draw(st.integers(0, 3))
    if split:
        pools = f"pool rollout = cpu x {gen_devices + extra}\npool learner = cpu x {learner_devices + extra}\n"
        on_gen, on_learn = "on rollout", "on learner"
    else:
        total = max(gen_devices, learner_devices) + draw(st.sampled_from([0, gen_devices + 2 * learner_devices]))
        pools, on_gen, on_learn = f"pool cpu = cpu x {total}\n", "", ""
    lines = [
        "pipeline random", pools,
        "model actor = custom { layers = 2, hidden = 32, heads = 4, vocab = 32 }",
        "model critic_m = custom { layers = 1, hidden = 32, heads = 4, vocab = 32 }",
        "model ref = frozen(actor)",
        f'data prompts = synthetic("arith") {{ prompts_per_step = {prompts}, group = {group}, '
        f"max_prompt = 16, max_response = {draw(st.sampled_from([8, 24, 64]))} }}",
        f"stage gen = generate(actor, prompts) {on_gen} {{ instances = {gen['instances']}, tp = {gen['tp']} }}",
        f'stage score = reward(gen, rule = "exact_match") {{ instances = {reward_instances} }}',
    ]
    inputs = ["actor", "gen"]
    if with_ref:
        lines.append(f"stage ref_lp = reference(ref, gen) {on_learn} {{ tp = {train['tp']} }}")
        inputs.append("ref_lp")
    if ppo:
        lines.append(f"stage values = critic(critic_m, gen) {on_learn}")
        lines.append("stage adv = advantage(score, values) { estimator = gae }")
        inputs += ["adv", "values"]
    else:
        lines.append("stage adv = advantage(score) { estimator = grpo }")
        inputs.append("adv")
    loss = "ppo" if ppo else "grpo"
    kl = 0.01 if with_ref else 0.0
    lines.append(f"stage update = train({', '.join(inputs)}) {on_learn} "
                 f"{{ loss = {loss}, kl = {kl}, tp = {train['tp']}, dp = {train['dp']}, micro_tokens = 512 }}")
    staleness = draw(st.integers(0, 3))
    partial = draw(st.integers(1, 2)) if staleness and draw(st.booleans()) else 0
    kind = draw(st.sampled_from(["asp", "sync", "sync-naive"]))
    if kind == "asp":
        lines.append(f"schedule asp {{ staleness = {staleness}, stream = {group * draw(st.integers(1, 3))}, "
                     f"partial_rollout = {partial}, buckets = {draw(st.integers(1, 4))}, "
                     f"dispatch = {draw(st.sampled_from(['queue_aware', 'least_requests', 'round_robin']))} }}")
    else:
        lines.append(f"schedule {kind}")
    return "\n".join(lines) + "\n"


def assert_plan_sound(graph, passes, staleness=None):
    assert verify_problems(graph) == []
    plan = build_plan(graph, passes)
    assert plan_problems(plan) == []
    for stage in plan.stages:
        assert len(stage.instances) == graph.stage(stage.name).instances
        for inst in stage.instances:
            assert inst.device_count == (graph.stage(stage.name).parallel.devices if stage.pool else 0)
    for channel in plan.channels:
        assert channel.capacity == (channel.staleness + 1) * channel.samples_per_step
        assert channel.staleness == (graph.schedule.option("staleness") if staleness is None else staleness)


@SETTINGS
@given(pipelines())
def test_schedule_pipeline_keeps_invariants_and_a_sound_plan(text):
    compiled = run_schedule(compile_source(text, "random.aspl"), verify_each=True)
    assert_plan_sound(compiled.graph, compiled.passes)


# in an order that keeps every declared constraint (`Pass.after`); the pass manager refuses others
PASS_CHOICES = ["continuous-batching", "place", "async-decouple", "queue-aware-dispatch", "stream", "pack"]


@SETTINGS
@given(pipelines(), st.lists(st.booleans(), min_size=len(PASS_CHOICES), max_size=len(PASS_CHOICES)),
       st.integers(0, 2), st.sampled_from(["asp", "sync", "sync-naive"]))
def test_any_subset_of_passes_keeps_invariants(text, keep, staleness, schedule):
    names = [n for n, k in zip(PASS_CHOICES, keep) if k]
    group = int(text.split("group = ")[1].split(",")[0])
    spelled = [f"async-decouple{{staleness={staleness}}}" if n == "async-decouple" else
               f"stream{{micro={group}}}" if n == "stream" else n for n in names]
    compiled = run_schedule(compile_source(text, "random.aspl"), schedule=schedule,
                            pipeline=",".join(spelled), verify_each=True)
    assert verify_problems(compiled.graph) == []
    if "place" in names:
        assert_plan_sound(compiled.graph, compiled.passes, staleness)
    else:
        with pytest.raises(PlanError, match="needs the `place` pass"):
            build_plan(compiled.graph, compiled.passes)
    assert bool(compiled.graph.stages_of(StageKind.CHANNEL)) == ("async-decouple" in names)


@SETTINGS
@given(pipelines())
def test_staleness_zero_keeps_one_step_in_the_channel(text):
    compiled = run_schedule(compile_source(text, "random.aspl"), pipeline="async-decouple{staleness=0},place")
    data = next(iter(compiled.graph.data.values()))
    for channel in compiled.graph.stages_of(StageKind.CHANNEL):
        assert channel.channel.capacity == data.samples_per_step
    assert all(s.weight_sync.staleness == 0 for s in compiled.graph.stages_of(StageKind.WEIGHT_SYNC))
