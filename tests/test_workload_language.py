"""The workload language: mixture(...) length distributions (per sample or per prompt), the
engine options max_num_seqs and gpu_memory_utilization end to end (checker, simulator, CPU
runtime, Ascend launch), and the warnings of tests/warnings/ (one file per kind, exit 0)."""
import random

import hypothesis
import pytest

from aspc.backends.ascend.lowering import lower
from aspc.backends.sim.pricing import RooflinePricing
from aspc.costmodel.workload import sample_step, standard_normals
from aspc.frontend.compiler import compile_source
from aspc.frontend.formatter import format_program
from aspc.frontend.parser import parse
from aspc.ir.serialize import from_json, to_json
from aspc.plan.execution_plan import ExecutionPlan
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT, check_golden

WORKLOADS = ROOT / "tests" / "workloads"
WARNINGS = sorted((ROOT / "tests" / "warnings").glob("*.aspl"))
CAP = 8192


def _data(response_lengths: str, prompts: int = 2000, group: int = 8):
    """The DataSpec of a data block with these response lengths, through the front end."""
    text = f"""pipeline p
pool cpu = cpu x 2
model actor = custom {{ layers = 2, hidden = 64, heads = 4, vocab = 32, max_seq = 64 }}
data prompts = synthetic("arith") {{
  prompts_per_step = {prompts}, group = {group}, max_prompt = 16, max_response = 8k
  response_lengths = {response_lengths}
}}
stage gen = generate(actor, prompts) on cpu {{ instances = 2 }}
stage score = reward(gen, rule = "exact_match")
stage adv = advantage(score)
stage update = train(actor, gen, adv) on cpu {{ micro_tokens = 9k }}
"""
    return compile_source(text, "w.aspl").graph.data["prompts"]


BIMODAL = "mixture(lognormal(mean = 1k, sigma = 0.6), fixed(length = 8k), weights = [0.7, 0.3]{per})"


def test_a_bimodal_mixture_puts_its_weight_at_the_cap():
    samples = sample_step(_data(BIMODAL.format(per="")), 0)
    at_cap = sum(s.response_len == CAP for s in samples) / len(samples)
    assert at_cap == pytest.approx(0.3, abs=0.02)  # a lognormal of mean 1k, sigma 0.6 almost never reaches 8k
    short = [s.response_len for s in samples if s.response_len < CAP]
    assert sum(short) / len(short) == pytest.approx(1024, rel=0.05)


def test_weights_are_relative():
    a = sample_step(_data(BIMODAL.format(per="")), 3)
    b = sample_step(_data(BIMODAL.format(per="").replace("[0.7, 0.3]", "[7, 3]")), 3)
    assert a == b


def _groups(samples, group):
    return [samples[i:i + group] for i in range(0, len(samples), group)]


def test_a_per_prompt_mixture_makes_whole_groups_long():
    narrow = BIMODAL.replace("sigma = 0.6", "sigma = 0.3")  # its short component never reaches the cap
    groups = _groups(sample_step(_data(narrow.format(per=', per = "prompt"'), prompts=1000), 0), 8)
    at_cap = [sum(s.response_len == CAP for s in g) for g in groups]
    assert set(at_cap) == {0, 8}  # all of a group at the cap, or none of it
    assert at_cap.count(8) / len(groups) == pytest.approx(0.3, abs=0.04)


def test_a_per_sample_mixture_splits_groups():
    groups = _groups(sample_step(_data(BIMODAL.format(per=""), prompts=1000), 0), 8)
    mixed = [g for g in groups if 0 < sum(s.response_len == CAP for s in g) < 8]
    assert len(mixed) > len(groups) / 2


def test_mixture_draws_are_deterministic_per_step_and_seed():
    data = _data(BIMODAL.format(per=', per = "prompt"'), prompts=64)
    assert sample_step(data, 5) == sample_step(data, 5)
    assert sample_step(data, 5) != sample_step(data, 6)
    assert sample_step(data, 5, seed=1) != sample_step(data, 5)


def test_the_workload_pipeline_prints_as_golden(aspc):
    result = aspc("compile", "tests/workloads/bimodal_7b.aspl", "--emit", "ir")
    assert result.exit_code == 0, result.output
    check_golden(WORKLOADS / "bimodal_7b.ir", result.stdout)


def test_the_workload_pipeline_launches_vllm_with_its_engine_options(aspc):
    result = aspc("compile", "tests/workloads/bimodal_7b.aspl", "--backend", "ascend", "--emit", "launch-summary")
    assert result.exit_code == 0, result.output
    check_golden(WORKLOADS / "bimodal_7b.launch.txt", result.stdout)
    [gen] = [s for s in lower(_plan()).stages if s.stage == "gen"]
    assert gen.config["max_num_seqs"] == 64 and gen.config["gpu_memory_utilization"] == 0.85
    assert max(gen.config["compilation_config"]["cudagraph_capture_sizes"]) == 64


def test_mixtures_format_and_serialize_back():
    source = (WORKLOADS / "bimodal_7b.aspl").read_text()
    program = parse(source, "w.aspl")
    assert parse(format_program(program), "w.aspl") == program
    graph = compile_source(source, "w.aspl").graph
    assert from_json(to_json(graph)) == graph
    plan = _plan()
    assert ExecutionPlan.from_json(plan.to_json()) == plan


def _plan(*overrides: str, path=WORKLOADS / "bimodal_7b.aspl"):
    return compile_with_passes(path, list(overrides)).plan()


def _capacity(plan) -> int:
    gen = plan.stages_of("generate")[0]
    return RooflinePricing(plan).generation_instance(gen, gen.instances[0]).capacity


def test_max_num_seqs_caps_the_simulated_decode_batch():
    assert _capacity(_plan()) == 64
    assert _capacity(_plan("gen.max_num_seqs=8")) == 8
    assert _capacity(_plan("gen.max_num_seqs=8", "gen.tp=2", "gen.dp=2")) == 16  # per data-parallel rank
    assert _capacity(_plan("gen.max_num_seqs=100000")) > 256  # then the KV room bounds it


def test_gpu_memory_utilization_sizes_the_simulated_kv_room():
    roomy = _capacity(_plan("gen.max_num_seqs=100000", "gen.gpu_memory_utilization=0.9"))
    tight = _capacity(_plan("gen.max_num_seqs=100000", "gen.gpu_memory_utilization=0.4"))
    assert 1 <= tight < roomy / 2


def test_without_engine_options_the_ir_and_the_defaults_are_unchanged():
    plan = compile_with_passes(ROOT / "pipelines" / "grpo_7b.aspl").plan()
    gen = plan.stages_of("generate")[0]
    assert "max_num_seqs" not in dict(gen.options) and "gpu_memory_utilization" not in dict(gen.options)
    [launch] = [s for s in lower(plan).stages if s.stage == "gen"]
    assert launch.config["max_num_seqs"] == 256 and launch.config["gpu_memory_utilization"] == 0.9


def test_max_num_seqs_caps_the_cpu_runtimes_slots():
    from aspc.backends.cpu.executors import CpuExecutors

    tiny = ROOT / "pipelines" / "tiny_grpo.aspl"
    assert CpuExecutors(_plan(path=tiny), tiny.parent).generation_engine(0, 2).slots == 32  # 64 samples / 2
    capped = CpuExecutors(_plan("gen.max_num_seqs=3", path=tiny), tiny.parent)
    assert capped.generation_engine(0, 2).slots == 3


def test_the_calibrated_simulator_uses_the_cpu_runtimes_capped_slots():
    from aspc.costmodel.calibrated import Calibration

    plan = _plan("gen.max_num_seqs=3", path=ROOT / "pipelines" / "tiny_grpo.aspl")
    gen = plan.stages_of("generate")[0]
    calibration = Calibration(**{name: 1.0 for name in Calibration.__dataclass_fields__})
    assert RooflinePricing(plan, calibration).generation_instance(gen, gen.instances[0]).capacity == 3


@pytest.mark.parametrize("case", WARNINGS, ids=lambda p: p.stem)
def test_warning_matches_golden(aspc, case):
    result = aspc("check", f"tests/warnings/{case.name}")
    assert result.exit_code == 0, result.output
    assert ": warning: " in result.stderr and "hint: " in result.stderr
    check_golden(case.with_suffix(".expected"), result.stderr)


def test_bundled_pipelines_leave_no_device_idle(aspc):
    for pipeline in sorted((ROOT / "pipelines").glob("*.aspl")):
        assert "stay idle" not in aspc("check", f"pipelines/{pipeline.name}").stderr


def test_the_checker_and_the_cost_model_default_to_the_same_memory_share():
    from aspc.costmodel.roofline import parameters
    from aspc.ir.memory import USABLE_HBM_FRACTION

    assert USABLE_HBM_FRACTION == parameters()["efficiency"]["memory"]


@hypothesis.given(seed=hypothesis.strategies.integers(0, 2**32), counts=hypothesis.strategies.lists(
    hypothesis.strategies.integers(0, 5), max_size=6))
def test_standard_normals_are_the_random_modules_gauss_draws(seed, counts):
    """The batched draw is CPython's gauss, number for number, and leaves the generator in the same
    state (its kept second Box-Muller member included), so every simulated length stays as it was."""
    batched, single = random.Random(seed), random.Random(seed)
    for n in counts:
        assert standard_normals(batched, n) == [single.gauss(0, 1) for _ in range(n)]
        assert batched.getstate() == single.getstate()
