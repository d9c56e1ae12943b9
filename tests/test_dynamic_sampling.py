"""DAPO dynamic sampling (`train { filter_groups = true }`): no group whose rewards are all equal
reaches the loss, every step still trains its full batch, the controller releases more prompts
of the same step for the ones it drops (bounded by max_oversample), and the simulator prices the
extra generation (aspc/controller/dynamic_sampling.py)."""
from collections import defaultdict

import pytest

from aspc.controller.dynamic_sampling import GroupFilter, OversampleBoundReached
from aspc.costmodel.workload import draw_rewards
from aspc.drivers.sim.driver import Simulation
from aspc.drivers.sim.result import collect
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from timed_fakes import FakePricing

PARITY = ("def parity(prompt, response, answer, metadata):\n    return float(len(response) % 2)\n\n\n"
          "def constant(prompt, response, answer, metadata):\n    return 1.0\n")
AT_BOUND = "filter_groups = true, max_oversample = 2, solve_rates = beta(a = 0.01, b = 0.01)"  # nearly all equal


def _plan(tmp_path, schedule: str = "asp", train: str = "filter_groups = true", **replace):
    text = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
    text = text.replace("micro_tokens = 1k\n}", f"micro_tokens = 1k, {train}\n}}" if train else "micro_tokens = 1k\n}")
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "filtered.aspl"
    path.write_text(text)
    (tmp_path / "ds_rewards.py").write_text(PARITY)
    return path, compile_with_passes(path, [], schedule).plan()


def test_no_all_equal_group_reaches_the_loss_and_each_step_trains_a_full_batch(tmp_path):
    """The CPU runtime on a tiny pipeline whose reward (the parity of the response's length)
    leaves some groups all-equal: what reaches the loss is whole groups with a signal, P x G a step."""
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions

    path, plan = _plan(tmp_path, **{"prompts_per_step = 16": "prompts_per_step = 4",
                                    'rule = "exact_match"': 'python = "ds_rewards:parity"'})
    runtime = LocalRuntime(plan, path.parent, RunOptions(steps=2, warmstart_steps=0), CpuExecutors)
    runtime.build()
    trained = defaultdict(dict)  # step -> sample -> the reward the loss saw
    train = runtime.learner.train

    def recording(rollouts):
        for r in rollouts:
            trained[r.key[0]][r.key] = r.reward
        return train(rollouts)

    runtime.learner.train = recording
    result = runtime.run()
    for step in range(2):
        groups = defaultdict(set)
        for (_, prompt, _), reward in trained[step].items():
            groups[prompt].add(reward)
        assert len(trained[step]) == 16 and len(groups) == 4  # the full batch: 4 prompts x 4 responses
        assert all(len(rewards) == 2 for rewards in groups.values())  # each group has a signal
    rows = result.metrics
    assert sum(r["filtered_groups"] for r in rows) >= 1 and all(r["padded_groups"] == 0 for r in rows)
    assert all(r["samples"] == 16 and r["oversample"] > 1 for r in rows)
    assert any(p >= 4 for step in trained.values() for _, p, _ in step)  # extra prompts of the same step trained


def test_a_run_that_pads_at_the_bound_says_so_once_in_full_then_counts(tmp_path):
    """A reward that never changes: every group is all-equal, every step pads at its bound (at
    max_oversample = 1, prompts_per_step prompts), trains, and the log warns at padded steps 1 and 2."""
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions

    path, plan = _plan(tmp_path, train="filter_groups = true, max_oversample = 1",
                       **{"prompts_per_step = 16": "prompts_per_step = 4",
                          'rule = "exact_match"': 'python = "ds_rewards:constant"'})
    warnings = []
    options = RunOptions(steps=2, warmstart_steps=0, on_warning=warnings.append)
    runtime = LocalRuntime(plan, path.parent, options, CpuExecutors)
    runtime.build()
    rows = runtime.run().metrics
    assert [r["padded_groups"] for r in rows] == [4, 4] and all(r["samples"] == 16 for r in rows)
    assert len(warnings) == 2
    assert warnings[0].startswith("warning: step 1 reached the dynamic sampling bound: it generated 4 prompts")
    assert "only 0 of their groups had rewards that differ" in warnings[0]
    assert "max_oversample" in warnings[0] and "at_oversample_bound = stop" in warnings[0]
    assert warnings[1].startswith("warning: 2 steps so far were completed with all-equal groups")


def test_the_padding_warnings_thin_out_to_powers_of_two():
    from aspc.controller.dynamic_sampling import PaddingWarnings

    groups, warnings = GroupFilter(prompts_per_step=1, group=2, max_prompts=1), []
    padding_warnings = PaddingWarnings(warnings.append)
    for step in range(9):
        groups.opening(step)
        groups.add_rewards(((step, 0, 0), (step, 0, 1)), (1.0, 1.0))
        groups.decide(step, 0)
        assert groups.padding(step) == [0]
        padding_warnings.record(groups, step)
    assert [w.split(" steps so far")[0] for w in warnings[1:]] == ["warning: 2", "warning: 4", "warning: 8"]


def test_stop_at_the_bound_ends_the_run_with_what_to_do(tmp_path):
    """at_oversample_bound = stop: the controller raises the user error where it would pad (the
    simulator, like every driver, carries it out)."""
    _, plan = _plan(tmp_path, train=AT_BOUND + ", at_oversample_bound = stop")
    with pytest.raises(OversampleBoundReached) as stopped:
        _simulate(plan)
    message = str(stopped.value)
    assert "reached the dynamic sampling bound: it generated 32 prompts (max_oversample x prompts_per_step)" in message
    assert "groups had rewards that differ, of the 16 a step trains" in message
    for advice in ("Raise max_oversample", "check the reward", "at_oversample_bound = pad", "max_num_gen_batches"):
        assert advice in message


def test_stop_at_the_bound_is_a_user_error_of_run_and_simulate(aspc, tmp_path):
    """No traceback: `aspc run` ends with the message (after keeping the finished steps), and
    `aspc simulate` says the simulated run stops."""
    path, _ = _plan(tmp_path, train="filter_groups = true, max_oversample = 1, at_oversample_bound = stop",
                    **{"prompts_per_step = 16": "prompts_per_step = 4",
                       'rule = "exact_match"': 'python = "ds_rewards:constant"'})
    result = aspc("run", str(path), "--steps", "2", "--warmstart", "0", "--metrics", str(tmp_path / "m.jsonl"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{path}: step 1 reached the dynamic sampling bound" in result.output
    result = aspc("simulate", str(path), "--steps", "2")
    assert result.exit_code == 1
    assert "the simulated run stops (asp, with the train stage's solve_rates): step" in result.output


def _simulate(plan, steps: int = 3) -> Simulation:
    sim = Simulation(plan, steps, FakePricing(plan))
    sim.run()
    return sim


def test_each_step_trains_its_first_groups_with_a_signal_whatever_the_schedule(tmp_path):
    """What a step trains is the first prompts_per_step prompts in release order whose rewards
    differ (as verl filters a generated batch), not the first groups to finish: sync and asp
    train the very same groups, and the long groups are not dropped for being slow."""
    trained = {}
    for schedule in ("sync", "asp"):
        _, plan = _plan(tmp_path, schedule)
        sim = _simulate(plan)
        rates, data = dict(plan.stages_of("train")[0].options)["solve_rates"], sim.data
        for step in range(3):
            signal = [p for p in range(4 * data.prompts_per_step) if len(set(draw_rewards(data, rates, step, p))) == 2]
            assert sim.controller.trained_prompts(step) == signal[:data.prompts_per_step]
        assert sim.controller.filter.steps[0].uniform  # some groups were all-equal and dropped
        assert sim.controller.learner.trained == {step: data.samples_per_step for step in range(3)}
        trained[schedule] = [sim.controller.trained_prompts(step) for step in range(3)]
    assert trained["sync"] == trained["asp"]


def test_a_step_at_its_bound_is_completed_with_all_equal_groups(tmp_path):
    """Solve rates near 0 or 1: nearly every group is all-equal. Each step generates at most
    max_oversample x prompts_per_step prompts, then trains the groups it has (padded)."""
    _, plan = _plan(tmp_path, train=AT_BOUND)
    sim = _simulate(plan)
    groups = sim.controller.filter
    prompts = sim.data.prompts_per_step
    for step in range(3):
        assert groups.steps[step].generated == 2 * prompts
        assert len(groups.steps[step].padded) > 0
        assert len(sim.controller.trained_prompts(step)) == prompts
    assert collect(sim).padded_groups == sum(len(groups.steps[s].padded) for s in range(3))


def test_the_simulator_prices_the_extra_generation(tmp_path):
    """The same plan with and without filtering: the filtered run generates more tokens than it
    trains, and its generation instances are busy longer."""
    _, plain = _plan(tmp_path, train="")
    _, filtered = _plan(tmp_path)
    base, more = collect(_simulate(plain)), collect(_simulate(filtered))
    assert base.oversample == 0 and more.oversample > 1 and 0 < more.filtered_tokens < 1
    assert more.pools["cpu"][1] > base.pools["cpu"][1]


def test_the_keep_rate_sizes_the_opening_and_the_top_ups():
    groups = GroupFilter(prompts_per_step=4, group=2, max_prompts=8)
    assert groups.opening(0) == 4  # nothing seen yet: no oversampling
    for prompt, rewards in [(3, (0.0, 1.0)), (0, (0.0, 0.0)), (1, (1.0, 0.0)), (2, (1.0, 1.0))]:
        groups.add_rewards(((0, prompt, 0), (0, prompt, 1)), rewards)
        groups.decide(0, prompt)
        assert groups.admissible(0) == {3: [3], 0: [], 1: [1], 2: []}[prompt]  # within the first 4: at once
    assert groups.steps[0].signal == {1, 3} and groups.steps[0].uniform == {0, 2}
    assert list(groups.top_up(0)) == [4, 5, 6, 7]  # 2 more needed at a keep rate of 3/5: 4 prompts
    assert list(groups.top_up(0)) == []  # they are pending
    for prompt in (6, 7, 4, 5):  # out of order: 6 waits until 4 is all-equal, 7 until 5 has a signal
        groups.add_rewards(((0, prompt, 0), (0, prompt, 1)), (0.0, 1.0) if prompt != 4 else (1.0, 1.0))
        groups.decide(0, prompt)
        assert groups.admissible(0) == {6: [], 7: [], 4: [6], 5: [5]}[prompt]
    assert groups.full(0) and groups.steps[0].admitted == [3, 1, 6, 5]  # 7 is fifth: surplus
    assert groups.opening(1) == 6  # ceil(4 / (6/9))


def test_a_masked_score_is_no_signal():
    groups = GroupFilter(prompts_per_step=1, group=3, max_prompts=2)
    groups.opening(0)
    groups.add_rewards(((0, 0, 0), (0, 0, 1), (0, 0, 2)), (1.0, None, 1.0))
    groups.decide(0, 0)
    assert groups.steps[0].uniform == {0} and groups.admissible(0) == []


def test_the_filter_options_are_refused_without_filter_groups(aspc, tmp_path):
    path, _ = _plan(tmp_path, train="filter_groups = true")
    path.write_text(path.read_text().replace("filter_groups = true", "max_oversample = 2"))
    result = aspc("check", str(path))
    assert result.exit_code == 1
    assert "'max_oversample' applies only with filter_groups = true" in result.output
    assert f"{path}:" in result.output


@pytest.mark.parametrize("train, message", [
    ("at_oversample_bound = stop", "'at_oversample_bound' applies only with filter_groups = true"),
    ("filter_groups = true, at_oversample_bound = halt", "'halt' is not a valid at_oversample_bound"),
])
def test_at_oversample_bound_is_refused_without_filter_groups_or_with_a_bad_value(aspc, tmp_path, train, message):
    path, _ = _plan(tmp_path, train="")
    path.write_text(path.read_text().replace("micro_tokens = 1k\n}", f"micro_tokens = 1k, {train}\n}}"))
    result = aspc("check", str(path))
    assert result.exit_code == 1
    assert message in result.output
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "at_oversample_bound" in text)
    assert f"{path}:{line}:" in result.output


def test_at_oversample_bound_is_in_the_plan_only_when_it_stops(tmp_path):
    for train, expected in [("filter_groups = true", None), ("filter_groups = true, at_oversample_bound = pad", None),
                            ("filter_groups = true, at_oversample_bound = stop", "stop")]:
        _, plan = _plan(tmp_path, train=train)
        assert dict(plan.stages_of("train")[0].options).get("at_oversample_bound") == expected


def test_simulate_prints_the_oversampling_cost(aspc):
    result = aspc("simulate", "pipelines/dapo_32b.aspl", "--steps", "2", "--set", "update.filter_groups=true",
                  "--set", "prompts.prompts_per_step=32")
    assert result.exit_code == 0, result.output
    assert "x prompts generated per prompt trained" in result.output


def test_the_ray_runtime_refuses_it_before_starting_ray(tmp_path):
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.controller.config import UnsupportedPlan
    from aspc.drivers.local.runtime import RunOptions
    from aspc.drivers.ray.runtime import RayRuntime

    path, plan = _plan(tmp_path)
    with pytest.raises(UnsupportedPlan, match="filter_groups"):
        RayRuntime(plan, path.parent, RunOptions(steps=1, warmstart_steps=0), CpuExecutors)
