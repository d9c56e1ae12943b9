"""The Ascend backend on CPU: golden launch plans, conformance of the lowered model configs with
megatron-core, a sound device mapping, and the clear message where no NPU exists."""
import json
import subprocess
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aspc.backends.ascend.executors import materialize
from aspc.backends.ascend.groups import process_groups
from aspc.backends.ascend.lowering import MEGATRON_KINDS, in_trainer, lower
from aspc.backends.ascend.topology import NPUS_PER_NODE, pool_offsets
from aspc.controller.kinds import JUDGE_VERDICT_TOKENS
from aspc.ir.facts import GIB, hardware_table
from aspc.ir.graph import Parallel
from aspc.cli.toolchain import compile_with_passes
from aspc.frontend.compiler import compile_source
from aspc.cli.toolchain import run_schedule
from conftest import ROOT, check_golden
from test_passes_properties import pipelines as random_pipelines

WORKLOADS = ["grpo_7b", "dapo_32b", "grpo_30b_moe", "r1_zero_671b", "grpo_7b_colocated"]


def launch(name, overrides=()):
    return lower(compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", list(overrides)).plan())


@pytest.mark.parametrize("name", WORKLOADS)
def test_launch_summary_matches_golden(aspc, name):
    """The golden is the reviewable per-stage summary; the full plan is checked structurally below."""
    result = aspc("compile", f"pipelines/{name}.aspl", "--backend", "ascend", "--emit", "launch-summary")
    assert result.exit_code == 0, result.output
    check_golden(ROOT / "tests" / "golden" / f"{name}.launch.txt", result.stdout)


@pytest.mark.parametrize("name", WORKLOADS)
def test_full_launch_plan_is_sound(aspc, name):
    result = aspc("compile", f"pipelines/{name}.aspl", "--backend", "ascend", "--emit", "launch")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    plan = compile_with_passes(ROOT / "pipelines" / f"{name}.aspl").plan()
    launch_plan = lower(plan)
    assert doc["format"] == "aspc.launch_plan" and len(doc["processes"]) == len(launch_plan.processes)
    assert len({p.name for p in launch_plan.processes}) == len(launch_plan.processes)
    offsets = pool_offsets(plan.pools)
    lowered = [s for s in plan.stages if s.pool is not None and (s.kind == "generate" or s.kind in MEGATRON_KINDS)]
    assert [s.stage for s in launch_plan.stages] == [s.name for s in lowered]
    # the reference and the critic run in the train stage's processes: none of their own
    assert not [p for p in launch_plan.processes if p.stage in {s.name for s in lowered if in_trainer(plan, s)}]
    for stage in (s for s in lowered if not in_trainer(plan, s)):
        procs = [p for p in launch_plan.processes if p.stage == stage.name]
        pool = next(p for p in plan.pools if p.name == stage.pool)
        # every device of every instance is held by exactly one process of the stage, inside its pool
        held = sorted(p.node * NPUS_PER_NODE + d for p in procs for d in p.devices)
        wanted = sorted(offsets[pool.name] + d for inst in stage.instances for d in inst.devices)
        assert held == wanted and len(held) <= pool.count
        world = procs[0].world_size
        assert all(p.world_size == world for p in procs)
        # ranks 0..world-1, once per instance (engines: data-parallel ranks; megatron: one job)
        assert Counter(p.rank for p in procs) == {r: len(procs) // world for r in range(world)}
        for p in procs:
            assert p.env["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, sorted(p.devices)))
            assert p.time_shared == (stage.placement == "time_shared")
            if p.role != "vllm-engine":
                assert (p.env["RANK"], p.env["WORLD_SIZE"]) == (str(p.rank), str(world))
                assert p.command[-2:] == ("--rank", str(p.rank))
    for sync in plan.weight_syncs:
        sent = sum(t.bytes for t in launch_plan.transfers if t.sync == sync.name)
        assert sent == pytest.approx(sync.bytes * len(plan.stage(sync.dst).instances), rel=1e-6)


@pytest.mark.parametrize("name", WORKLOADS)
def test_megatron_configs_construct_in_megatron_core(name):
    transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")
    for stage in launch(name).stages:
        if stage.role == "vllm-engine":
            continue
        config = dict(materialize(stage.config), use_cpu_initialization=True)
        cls = transformer_config.MLATransformerConfig if config.get("multi_latent_attention") \
            else transformer_config.TransformerConfig
        built = cls(**config)
        assert built.num_layers == config["num_layers"]
        assert built.tensor_model_parallel_size == config["tensor_model_parallel_size"]
        assert built.hidden_dropout == built.attention_dropout == 0.0  # megatron's defaults are 0.1


def test_a_tiny_gpt_model_builds_from_the_lowering(tmp_path):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    plan = compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl").plan()
    stage = next(s for s in lower(plan).stages if s.kind == "train")
    arch = plan.model("actor").arch
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        config = TransformerConfig(**materialize(stage.config), use_cpu_initialization=True)
        model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), **stage.model_args)
        assert sum(p.numel() for p in model.parameters()) > 0
        assert model.config.num_query_groups == arch.kv_heads
    finally:
        parallel_state.destroy_model_parallel()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]),
       st.sampled_from([1, 2, 4]))
def test_process_groups_partition_the_ranks(tp, pp, dp, cp, ep):
    par = Parallel(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep if (dp * cp) % ep == 0 else 1)
    groups = process_groups(par)
    world = list(range(par.devices))
    for axis, size in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp)):
        assert sorted(r for g in groups[axis] for r in g) == world
        assert all(len(g) == size for g in groups[axis])
    if par.ep > 1:
        assert sorted(r for g in groups["ep"] for r in g) == world
        assert all(len(g) == par.ep for g in groups["ep"])


def test_weight_transfers_carry_every_instance_its_weights():
    plan = launch("dapo_32b")
    total = sum(t.bytes for t in plan.transfers)
    model_bytes = 65_527_752_704
    assert total == pytest.approx(8 * model_bytes, rel=1e-6)  # 8 generate instances, TP8 PP2 -> TP4
    assert {t.dst_tp_rank for t in plan.transfers} == {0, 1, 2, 3}


def test_missing_npu_stack_gives_the_clear_message(aspc):
    result = aspc("run", "pipelines/tiny_grpo.aspl", "--backend", "ascend")
    assert result.exit_code == 1
    for hint in ("torch-npu", "--dry-run", "--backend cpu", "aspc simulate"):
        assert hint in result.output
    assert "Traceback" not in result.output


def test_dry_run_prints_every_process(aspc):
    result = aspc("run", "pipelines/grpo_7b.aspl", "--backend", "ascend", "--dry-run")
    assert result.exit_code == 0
    commands = [line for line in result.stdout.splitlines() if "aspc.backends.ascend.executors" in line]
    assert len(commands) == len(launch("grpo_7b").processes)
    assert all("ASCEND_RT_VISIBLE_DEVICES=" in c and "HCCL_CONNECT_TIMEOUT=" in c for c in commands)


def test_emit_launch_needs_the_ascend_backend(aspc):
    result = aspc("compile", "pipelines/grpo_7b.aspl", "--emit", "launch")
    assert result.exit_code == 2 and "--backend ascend" in result.output


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_plans_lower_to_a_sound_device_mapping(data):
    text = data.draw(random_pipelines())
    launch_plan = lower(run_schedule(compile_source(text, "random.aspl")).plan())
    owners = {}
    for p in launch_plan.processes:
        for d in p.devices:
            owners.setdefault((p.node, d), []).append(p)
    for users in owners.values():
        assert len(users) == 1 or all(u.time_shared for u in users)
        assert len({u.name for u in users}) == len(users)
    for stage in launch_plan.stages:
        if stage.groups:
            world = sum(len(g) for g in stage.groups["tp"])
            assert all(sorted(r for g in stage.groups[a] for r in g) == list(range(world)) for a in ("tp", "dp", "pp"))


def _grpo_7b_with(tmp_path, reward: str, pool: str = "pool judges = 910b3 x 8"):
    text = (ROOT / "pipelines" / "grpo_7b.aspl").read_text().replace(
        "pool learner = 910b3 x 8", "pool learner = 910b3 x 8\n" + pool).replace(
        "model ref = frozen(actor)", "model ref = frozen(actor)\nmodel rm = qwen2.5-7b").replace(
        'reward(gen, rule = "math_verify")', reward)
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "math.jsonl").write_text((ROOT / "pipelines" / "data" / "math.jsonl").read_text())
    path = tmp_path / "p.aspl"
    path.write_text(text)
    return lower(compile_with_passes(path, []).plan())


def test_a_reward_model_is_a_megatron_forward_job_per_instance(tmp_path):
    """Nothing on a pool is left out of the launch plan: a reward model runs forward-only on
    megatron-core (hidden states out, a scalar head on the last token), one job per instance."""
    plan = _grpo_7b_with(tmp_path, "reward(gen, model = rm) on judges { tp = 4, instances = 2 }")
    score = next(s for s in plan.stages if s.stage == "score")
    assert score.role == "megatron-forward" and "post_process" not in score.model_args
    assert all(p.model_args["post_process"] is False for p in plan.processes if p.stage == "score")
    assert score.config["tensor_model_parallel_size"] == 4 and "scalar" not in score.config
    procs = [p for p in plan.processes if p.stage == "score"]
    assert len(procs) == 8 and {p.world_size for p in procs} == {4}
    assert Counter(p.rank for p in procs) == {r: 2 for r in range(4)}  # two jobs of four ranks
    assert len({p.env["MASTER_PORT"] for p in procs}) == 2
    held = sorted(p.node * NPUS_PER_NODE + d for p in procs for d in p.devices)
    assert held == sorted(set(held)) and len(held) == 8  # every judges NPU once


def test_a_judge_is_a_greedy_vllm_engine_with_a_short_verdict(tmp_path):
    plan = _grpo_7b_with(tmp_path, 'reward(gen, sources = [judge(model = rm, prompt = "grade")]) on judges { tp = 4 }')
    judge = next(s for s in plan.stages if s.stage == "score")
    assert judge.role == "vllm-engine" and judge.config["tensor_parallel_size"] == 4
    assert judge.micro_batching["sampling"]["temperature"] == 0.0
    assert judge.micro_batching["sampling"]["max_tokens"] == JUDGE_VERDICT_TOKENS  # what the simulator prices
    assert [p.role for p in plan.processes if p.stage == "score"] == ["vllm-engine"]


ALL_PIPELINES = sorted(p.stem for p in (ROOT / "pipelines").glob("*.aspl"))


@pytest.mark.parametrize("name", ALL_PIPELINES)
def test_dry_run_prints_a_runnable_script_for_every_pipeline(aspc, name, tmp_path):
    """One line per process of the launch plan that tests/test_ascend_conformance.py checks (the same
    lowering), a script bash accepts, rendezvous addresses read from ASPC_NODES, and a placeholder
    checkpoint named in the header."""
    result = aspc("run", f"pipelines/{name}.aspl", "--backend", "ascend", "--dry-run")
    assert result.exit_code == 0, result.output
    path = ROOT / "pipelines" / f"{name}.aspl"
    plan = lower(compile_with_passes(path).plan(), path.parent)
    commands = [line for line in result.stdout.splitlines() if "aspc.backends.ascend.executors" in line]
    assert len(commands) == len(plan.processes)
    script = tmp_path / "launch.sh"
    script.write_text(result.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    masters = [line for line in commands if "MASTER_ADDR=" in line or "VLLM_DP_MASTER_IP=" in line]
    assert all('"${NODE[' in line for line in masters)
    assert ("ASPC_NODES" in result.stdout) == bool(masters)
    for placeholder in plan.placeholders():
        assert f"MISSING CHECKPOINT: replace {placeholder}" in result.stdout


def test_node_addresses_from_the_environment_are_written_in(aspc, monkeypatch):
    monkeypatch.setenv("ASPC_NODES", ",".join(f"10.0.0.{n}" for n in range(2)))
    result = aspc("run", "pipelines/grpo_7b.aspl", "--backend", "ascend", "--dry-run")
    assert result.exit_code == 0 and "MASTER_ADDR=10.0.0." in result.stdout and "NODE[" not in result.stdout
    monkeypatch.setenv("ASPC_NODES", "10.0.0.0")
    result = aspc("compile", "pipelines/grpo_7b.aspl", "--backend", "ascend", "--emit", "launch")
    assert result.exit_code == 1 and "ASPC_NODES lists 1 addresses" in result.output


def test_colocated_engines_share_memory_and_sleep_without_expandable_segments():
    """vllm-ascend's sleep-mode allocator asserts against expandable segments; two processes start on
    each NPU (the engine and the trainer, whose process holds the reference too), so the engine asks for
    less than half of the memory; each sharer has HCCL ports of its own."""
    plan = launch("grpo_7b_colocated")
    [gen] = [s for s in plan.stages if s.stage == "gen"]
    assert gen.config["enable_sleep_mode"] and gen.config["gpu_memory_utilization"] == 0.45
    engines = [p for p in plan.processes if p.stage == "gen"]
    assert all("PYTORCH_NPU_ALLOC_CONF" not in p.env and p.env["VLLM_ASCEND_ENABLE_NZ"] == "0" for p in engines)
    for node in {p.node for p in plan.processes}:
        ranges = [p.env["HCCL_HOST_SOCKET_PORT_RANGE"] for p in plan.processes if p.node == node]
        assert len(ranges) == len(set(ranges))
    assert gen.micro_batching["weight_refresh"]["backend"] == "npu_ipc"


def test_moe_engine_ranks_form_a_vllm_data_parallel_group():
    plan = launch("r1_zero_671b")
    [gen] = [s for s in plan.stages if s.stage == "gen"]
    assert "data_parallel_size" not in gen.config
    first = [p for p in plan.processes if p.stage == "gen" and p.name.startswith("gen.0.")]
    assert [p.env["VLLM_DP_RANK"] for p in first] == [str(r) for r in range(32)]
    assert {p.env["VLLM_DP_SIZE"] for p in first} == {"32"}
    assert {p.env["VLLM_DP_MASTER_IP"] for p in first} == {"${NODE[0]}"}
    assert sorted(p.env["VLLM_DP_RANK_LOCAL"] for p in first if p.node == 1) == ["0", "1", "2", "3"]


def test_pipeline_and_model_settings_reach_megatron():
    """DeepSeek: MLA config, YaRN, sigmoid group-limited router, 61 layers over 6 stages; the first
    pipeline stage embeds, the last one has the output layer."""
    plan = launch("r1_zero_671b")
    [update] = [s for s in plan.stages if s.stage == "update"]
    assert update.builders["config_class"] == "MLATransformerConfig"
    assert update.builders["layer_spec"]["function"] == "get_gpt_decoder_block_spec"
    assert update.config["rope_type"] == "yarn" and update.config["rotary_base"] == 10_000
    assert update.config["moe_router_score_function"] == "sigmoid"
    assert update.config["num_layers_in_last_pipeline_stage"] == 11
    ranks = [p for p in plan.processes if p.stage == "update"]
    assert Counter((p.model_args["pre_process"], p.model_args["post_process"]) for p in ranks) == \
        {(True, False): 64, (False, False): 256, (False, True): 64}
    [qwen3] = [s for s in launch("grpo_30b_moe").stages if s.stage == "update"]
    assert qwen3.config["qk_layernorm"] and qwen3.model_args["rotary_base"] == 1_000_000


def test_context_parallelism_switches_on_mindspeeds_ring_attention():
    [update] = [s for s in launch("dapo_32b").stages if s.stage == "update"]
    argv = update.builders["mindspeed_argv"]
    assert argv[argv.index("--context-parallel-size") + 1] == "2"
    assert argv[argv.index("--context-parallel-algo") + 1] == "megatron_cp_algo"
    assert int(argv[argv.index("--seq-length") + 1]) % 4 == 0


def _shard_and_kv_bytes(model, config: dict, dp_size: int) -> float:
    """One engine process's weights per NPU under vLLM's layout (dense weights over tp and pp, routed
    experts over the expert-parallel group dp x tp) plus vLLM's minimum KV cache (one request of
    max_model_len), from the plan's model config alone."""
    arch, tp, pp = model.arch, config["tensor_parallel_size"], config["pipeline_parallel_size"]
    ep = dp_size * tp if config["enable_expert_parallel"] else 1
    nbytes = {"bfloat16": 2, "float16": 2, "float32": 4}[config["dtype"]]
    hidden, moe_layers = arch.hidden, (arch.layers - arch.dense_layers if arch.experts else 0)
    experts = moe_layers * arch.experts * 3 * hidden * arch.expert_ffn
    total = arch.total_params()
    shard = ((total - experts) / tp + experts / ep) / pp * nbytes
    if arch.attention == "mla":
        kv_token = (arch.kv_lora_rank + arch.qk_rope_dim) * arch.layers * nbytes  # latent, not split by tp
    else:
        kv_token = 2 * arch.head_dim * arch.kv_heads * arch.layers * nbytes / min(tp, arch.kv_heads)
    return shard + kv_token * config["max_model_len"] / pp


@pytest.mark.parametrize("name", ALL_PIPELINES)
def test_every_engines_memory_share_holds_its_shard_and_a_kv_cache(name):
    """gpu_memory_utilization x the NPU's memory must hold the engine's weight shard and one
    max_model_len of KV cache, or vLLM cannot start (colocated engines included)."""
    path = ROOT / "pipelines" / f"{name}.aspl"
    plan = compile_with_passes(path).plan()
    launch_plan = lower(plan, path.parent)
    for stage in (s for s in launch_plan.stages if s.role == "vllm-engine"):
        hbm = hardware_table()[plan.pool(plan.stage(stage.stage).pool).hardware].hbm_gib * GIB
        model = _model_of(plan, stage)
        dp_size = max(int(p.env.get("VLLM_DP_SIZE", 1)) for p in launch_plan.processes if p.stage == stage.stage)
        need = _shard_and_kv_bytes(model, stage.config, dp_size)
        assert stage.config["gpu_memory_utilization"] * hbm >= need, (stage.stage, need / 1e9)


def _model_of(plan, stage):
    """The engine's model: the generated model, or a judge source's."""
    source = plan.stage(stage.stage)
    judge = [s for s in dict(source.options).get("sources", ()) if s.func == "judge"]
    return plan.model(judge[0].get("model") if judge else source.model)


def test_a_colocated_engine_that_needs_more_starts_first_and_sleeps(aspc):
    """DeepSeek-V3's engine shard (~37 GB on a 64 GiB 910B) needs more than a third of the NPU: the
    engine gets what it needs, starts alone and sleeps before the trainers on its NPUs start."""
    plan = launch("r1_zero_671b")
    stages = {s.stage: s for s in plan.stages}
    assert stages["gen"].config["gpu_memory_utilization"] > 0.3
    assert stages["gen"].startup == {"phase": 0, "then": {"call": "sleep", "level": 1}}
    assert stages["update"].startup == {"phase": 1, "after_asleep": ["gen"]}
    assert stages["ref_lp"].startup == {}  # the reference starts in update's processes
    script = aspc("run", "pipelines/r1_zero_671b.aspl", "--backend", "ascend", "--dry-run").stdout
    node0 = script.split("# ---- node0 ----")[1].split("# ---- node1")[0]
    stages_in_order = [line.split("--stage ")[1].split()[0] for line in node0.splitlines() if "--stage" in line]
    assert stages_in_order[:4] == ["gen"] * 4 and "gen" not in stages_in_order[4:]


def test_every_process_binds_hccl_and_gloo_sockets_to_one_interface(tmp_path, monkeypatch):
    """HCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME in every launched process: ASPC_SOCKET_IFNAME when
    given at compile time; otherwise the launch script sets SOCKET_IFNAME on each node (the
    default-route interface) and the runtimes' own processes resolve it the same way."""
    from aspc.backends.ascend.launch import launch_script
    from aspc.backends.ascend.process_env import default_route_interface, resolved

    plan = compile_with_passes(ROOT / "pipelines" / "grpo_7b.aspl").plan()
    named = lower(plan, socket_ifname="enp189s0f0")
    assert all(p.env["HCCL_SOCKET_IFNAME"] == p.env["GLOO_SOCKET_IFNAME"] == "enp189s0f0" for p in named.processes)
    assert "\nSOCKET_IFNAME=" not in launch_script(named)
    per_node = lower(plan)
    assert all(p.env["HCCL_SOCKET_IFNAME"] == "${SOCKET_IFNAME}" for p in per_node.processes)
    script = launch_script(per_node)
    assert 'SOCKET_IFNAME="${ASPC_SOCKET_IFNAME:-$(ip -o -4 route show to default' in script
    assert 'HCCL_SOCKET_IFNAME="${SOCKET_IFNAME}"' in script
    routes = tmp_path / "route"
    routes.write_text("Iface\tDestination\tGateway\nlo\t0000007F\t00000000\nbond0\t00000000\t0101A8C0\n")
    assert default_route_interface(str(routes)) == "bond0" and default_route_interface(str(tmp_path / "none")) is None
    env = {"RANK": "0", "HCCL_SOCKET_IFNAME": "${SOCKET_IFNAME}"}
    assert resolved(env, {"ASPC_SOCKET_IFNAME": "eth1"}) == {"RANK": "0", "HCCL_SOCKET_IFNAME": "eth1"}
    monkeypatch.setattr("aspc.backends.ascend.process_env.default_route_interface", lambda: None)
    assert resolved(env, {}) == {"RANK": "0"}  # no interface known: HCCL and gloo choose
