"""The Ascend executors' protocol on CPU: the real controller and local driver drive VllmEngine
(backends/ascend/engine_actor.py) over a fake of vLLM's offline API, whose "model" is the CPU
backend's tiny generator; weight refreshes go through vLLM's weight-transfer calls while the
trainer side broadcasts over an in-process communicator (backends/ascend/weight_sync.py).
The megatron side builds real megatron-core modules on CPU where it can."""
import dataclasses
import json
import itertools
import os
from types import SimpleNamespace

import pytest
import torch

from aspc.backends.ascend.engine_actor import VllmEngine
from aspc.backends.ascend.engine_args import weight_refresh
from aspc.backends.ascend.lowering import lower
from aspc.backends.ascend.run_executors import AscendExecutors
from aspc.backends.ascend.packing import pack, per_sequence
from aspc.backends.ascend.weight_sync import WeightSender, receive_hf, send_hf
from aspc.backends.cpu.executors import CpuExecutors
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from fake_comm import Hub, ThreadCommunicator

TINY = ROOT / "pipelines" / "tiny_grpo.aspl"


# ---- a fake of vLLM 0.23's offline API (names as in vllm/entrypoints/llm.py, vllm/outputs.py) ----
@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = 16
    seed: int | None = None
    logprobs: int | None = None


class FakeLLM:
    """LLM(**engine_args) whose engine decodes with a CPU BatchGenerator; it records every call
    the executor makes, and receives weights as vllm-ascend's worker does (broadcast per tensor)."""

    def __init__(self, generator, comm, **engine_args):
        self.generator, self.comm, self.engine_args = generator, comm, engine_args
        self.calls: list[str] = []
        self.received: dict = {}
        self.llm_engine = SimpleNamespace(add_request=self._add_request, step=self._step)

    def _add_request(self, request_id, prompt, params):
        assert isinstance(request_id, str) and params.logprobs == 0
        self.generator.add(request_id, prompt["prompt_token_ids"], params.seed)

    def _step(self):
        outputs = []
        for f in self.generator.step():
            logprobs = [{token: SimpleNamespace(logprob=lp)} for token, lp in zip(f.response, f.logprobs)]
            completion = SimpleNamespace(token_ids=f.response, logprobs=logprobs, finish_reason="stop")
            outputs.append(SimpleNamespace(request_id=f.key, prompt_token_ids=f.prompt, outputs=[completion],
                                           finished=True))
        return outputs

    def init_weight_transfer_engine(self, request):
        self.calls.append("init_weight_transfer_engine")
        assert set(request["init_info"]) == {"master_address", "master_port", "rank_offset", "world_size"}

    def start_weight_update(self, is_checkpoint_format=True):
        self.calls.append("start_weight_update")
        self.received = {}

    def update_weights(self, request):
        self.calls.append("update_weights")
        receive_hf(request["update_info"], self.comm, [0, 1], lambda pairs: self.received.update(pairs))

    def finish_weight_update(self):
        self.calls.append("finish_weight_update")
        self.generator.load_weights(self.received)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True

    def sleep(self, level=1):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({tags})")


class FakeNpuExecutors(CpuExecutors):
    """The CPU backend's host side (prompts, rewards, the learner), with every generation instance
    a VllmEngine over FakeLLM and every weight refresh a broadcast from the trainer's sender."""

    def __init__(self, plan, base_dir, seed=0):
        super().__init__(plan, base_dir, seed)
        self.launch = dataclasses.asdict(next(s for s in lower(plan, base_dir).stages if s.kind == "generate"))
        self.hubs: dict[int, Hub] = {}
        self.sender = WeightSender(self._send)
        self.versions = itertools.count()
        self.engines: list[VllmEngine] = []

    def _hub(self, instance):
        return self.hubs.setdefault(instance, Hub())

    def _send(self, tensors, instance):
        send_hf(tensors, ThreadCommunicator(0, self._hub(instance)), [0, 1])

    def generation_engine(self, index, instances):
        generator = super().generation_engine(index, instances)
        comm = ThreadCommunicator(1, self._hub(index))
        api = SimpleNamespace(LLM=lambda **args: FakeLLM(generator, comm, **args), SamplingParams=SamplingParams)
        engine = VllmEngine(self.launch, index, api)
        engine.connect({"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2})
        self.engines.append(engine)
        return engine

    def snapshot(self):
        return self._publish(super().snapshot())

    def trainer(self):
        learner = super().trainer()
        if not hasattr(learner, "cpu_snapshot"):
            learner.cpu_snapshot, learner.snapshot = learner.snapshot, lambda: self._publish(learner.cpu_snapshot())
        return learner

    def _publish(self, snapshot):
        state = getattr(snapshot, "state", snapshot)  # the learner's PolicyWeights, or a state dict
        return self.sender.publish(getattr(snapshot, "version", next(self.versions)), state)


def tiny_plan(overrides=("schedule.staleness=0",)):
    return compile_with_passes(TINY, list(overrides)).plan()


def run(executors, steps=2):
    runtime = LocalRuntime(tiny_plan(), ROOT / "pipelines", RunOptions(steps=steps, warmstart_steps=0), executors)
    runtime.build()
    return runtime, runtime.run().metrics


def test_the_controller_drives_vllm_engines_as_it_drives_the_cpu_generators():
    """Same plan, same seeds: the fake-vLLM run trains the same samples per step as the CPU run,
    and its first step (identical weights, identical seeds) generates the same responses with the
    same behaviour log-probs (the importance weight compares them with the learner's)."""
    runtime, metrics = run(FakeNpuExecutors)
    _, cpu = run(CpuExecutors)
    assert [m["trained"] for m in metrics] == [m["trained"] for m in cpu]
    for key in ("reward", "response_len", "is_weight"):
        assert metrics[0][key] == cpu[0][key], key
    engines = runtime.executors.engines
    assert len(engines) == 2 and all(not e.busy for e in engines)
    for engine in engines:
        assert engine.llm.engine_args["max_num_seqs"] == engine.slots
        first, *calls = engine.llm.calls
        assert first == "init_weight_transfer_engine"
        refresh = ["start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache"]
        assert calls and calls == refresh * (len(calls) // 4)


def test_a_refresh_loads_exactly_the_published_tensors():
    executors = FakeNpuExecutors(tiny_plan(), ROOT / "pipelines")
    engine = executors.generation_engine(0, 2)
    weights = {name: torch.randn_like(t) for name, t in executors.actor.state_dict().items()}
    engine.load_weights(executors.sender.publish(7, weights))
    loaded = engine.llm.generator.model.state_dict()
    assert all(torch.equal(loaded[name], weights[name]) for name in weights)
    assert engine.version == 7


def test_a_colocated_engine_sleeps_and_wakes_weights_then_kv_cache_around_the_refresh():
    """The launch plan's colocated refresh (engine_args.weight_refresh): sleep, wake the weights,
    receive them, wake the KV cache; an engine given work without a refresh wakes whole."""
    plan = tiny_plan()
    executors = FakeNpuExecutors(plan, ROOT / "pipelines")
    shared = dataclasses.replace(plan.stages_of("generate")[0], placement="time_shared")
    executors.launch["micro_batching"]["weight_refresh"] = weight_refresh(shared)
    engine = executors.generation_engine(0, 2)
    engine.sleep()
    engine.load_weights(executors.snapshot())
    assert engine.llm.calls[1:] == ["sleep(1)", "wake_up(['weights'])", "start_weight_update", "update_weights",
                                    "finish_weight_update", "wake_up(['kv_cache'])", "reset_prefix_cache"]
    engine.sleep()
    engine.add(("k",), [1, 2, 3], seed=1)
    assert engine.llm.calls[-2:] == ["sleep(1)", "wake_up(None)"]
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep()


def test_an_engine_outside_the_transfer_group_refuses_a_refresh_before_anything_is_sent():
    executors = FakeNpuExecutors(tiny_plan(), ROOT / "pipelines")
    engine = executors.generation_engine(0, 2)
    engine.connected = False
    with pytest.raises(RuntimeError, match="weight-transfer group"):
        engine.load_weights(executors.snapshot())
    assert engine.llm.calls == ["init_weight_transfer_engine"]


def test_a_failed_send_surfaces_on_the_engine_side():
    def broken(tensors, instance):
        raise ConnectionError("HCCL group of instance 0 is gone")

    sender = WeightSender(broken)
    published = sender.publish(1, {"w": torch.zeros(2)})
    with pytest.raises(ConnectionError, match="gone"):
        sender.wait(sender.start(published.version, 0))


def test_only_the_newest_versions_stay_staged():
    sender = WeightSender(lambda tensors, instance: None, keep=2)
    for version in range(4):
        sender.publish(version, {"w": torch.full((1,), float(version))})
    assert sorted(sender.staged.versions) == [2, 3]


# ---- the megatron side ----
def rollout(key, prompt, response, ref=None):
    return SimpleNamespace(key=key, prompt=prompt, response=response, behaviour_logprobs=[-0.5] * len(response),
                           ref_logprobs=ref)


def test_packed_rows_carry_the_reference_log_probs_for_the_kl_term():
    """The KL penalty needs each response token's reference log-prob beside its label; a row with
    a rollout the reference has not scored carries none (no KL term for it)."""
    scored = [rollout("a", [1, 2], [3, 4], ref=[-1.0, -2.0]), rollout("b", [5], [6, 7, 8], ref=[-3.0, -4.0, -5.0])]
    [mb] = pack(scored, tokens=12)
    assert per_sequence(mb.ref_logprobs, mb) == {"a": [-1.0, -2.0], "b": [-3.0, -4.0, -5.0]}
    [unscored] = pack([rollout("c", [1], [2])], tokens=12)
    assert unscored.ref_logprobs is None


def test_packing_keeps_sequences_apart_and_every_response_token_in_the_loss():
    rollouts = [rollout("a", [1, 2, 3], [4, 5]), rollout("b", [6, 7], [8, 9, 10]), rollout("c", [1] * 6, [2] * 3)]
    batches = pack(rollouts, tokens=12, advantages={"a": 1.0, "b": -1.0, "c": 0.5})
    assert sorted(k for mb in batches for k in mb.keys) == ["a", "b", "c"]
    assert sum(int(mb.loss_mask.sum()) for mb in batches) == 2 + 3 + 3
    mb = next(mb for mb in batches if "a" in mb.keys and "b" in mb.keys)
    masked = mb.attention_mask[0, 0]
    a, b = mb.spans[mb.keys.index("a")], mb.spans[mb.keys.index("b")]
    assert masked[b[0], a[0]] and not masked[b[0], b[0] - 1]  # b sees itself, never a
    labels = mb.labels[0].tolist()
    assert [labels[i] for i in range(*a)] == [4, 5] and [labels[i] for i in range(*b)] == [8, 9, 10]
    per = per_sequence(mb.advantages, mb)
    assert per["a"] == [1.0, 1.0] and per["b"] == [-1.0] * 3
    with pytest.raises(ValueError, match="exceeds"):
        pack([rollout("d", [1] * 10, [2] * 10)], tokens=12)


def test_every_rank_of_a_megatron_job_runs_rank_zeros_calls_and_reshards_over_torch_distributed(tmp_path):
    """Two processes over gloo: the follower runs the model calls (not the host-only reward), the
    critic's on its own critic; then both reshard TP2 -> TP1 in place, and gather the Hugging Face
    checkpoint on rank 0, through weight_sync.TorchCommunicator's real collectives."""
    import torch.multiprocessing as mp

    import follower_job

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(follower_job.run, args=(str(tmp_path / "store"), results), nprocs=2, start_method="spawn")
    ranks = dict(results.get() for _ in range(2))
    model_calls = [("train", (["r1", "r2"],)), ("optimizer_step", ()), ("snapshot", ())]
    critic_calls = [("values", (["r1", "r2"],)), ("train", (["r1", "r2"],))]
    assert ranks[0][0] == [("reward", (["r1"],))] + model_calls
    assert ranks[1][0] == model_calls
    assert ranks[0][1] == ranks[1][1] == critic_calls
    assert all(in_place and gathered for _, _, in_place, gathered in ranks.values())


@pytest.fixture
def one_rank(tmp_path):
    """megatron's model-parallel state on one CPU rank (gloo)."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()


def megatron_layout(model) -> dict:
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}


def test_the_lowered_train_stage_builds_a_megatron_model_in_the_reshard_layout(one_rank):
    """build_gpt follows the launch plan's builders; the parameters megatron-core 0.16.1 creates are
    exactly the names and shapes the weight sync reshards (backends/ascend/reshard.py)."""
    from aspc.backends.ascend import reshard
    from aspc.backends.ascend.megatron_model import build_gpt, layout_of

    plan = tiny_plan()
    launch = lower(plan, ROOT / "pipelines")
    stage = next(s for s in launch.stages if s.kind == "train")
    rank0 = next(p for p in launch.processes if p.stage == stage.stage and p.rank == 0)
    model = build_gpt(dataclasses.asdict(stage), rank0.model_args, use_cpu_initialization=True)
    assert megatron_layout(model) == reshard.full_shapes(plan.model(plan.stages_of("train")[0].model).arch)
    arch, parallel, layout = layout_of(dataclasses.asdict(stage), rank0.world_size)  # what a follower rank reads back
    assert reshard.full_shapes(arch, layout) == megatron_layout(model) and parallel.devices == rank0.world_size


def test_a_moe_model_with_qk_norm_has_the_reshard_layout_in_megatron(one_rank):
    """Experts as megatron's SequentialMLP holds them (moe_grouped_gemm off), Qwen3's q/k norm."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from aspc.backends.ascend import reshard
    from aspc.ir.facts import ModelArch

    arch = ModelArch(layers=2, hidden=16, heads=4, kv_heads=2, head_dim=4, ffn=32, vocab=64, experts=4, top_k=2,
                     expert_ffn=8, qkv_bias=True, qk_norm=True)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, kv_channels=4,
                               ffn_hidden_size=32, normalization="RMSNorm", gated_linear_unit=True,
                               add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True, num_moe_experts=4,
                               moe_router_topk=2, moe_ffn_hidden_size=8, moe_token_dispatcher_type="allgather",
                               use_cpu_initialization=True, activation_func=torch.nn.functional.silu)
    spec = get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=32,
                     position_embedding_type="rope")
    assert megatron_layout(model) == reshard.full_shapes(arch)


NPU_PIPELINE = TINY.read_text().replace("pool cpu = cpu x 2", "pool cpu = 910b3 x 2")


def test_the_ray_driver_places_instances_and_the_learner_on_npu_bundles(tmp_path):
    """On an Ascend pool every generation actor asks for its instance's NPUs and the learner for
    its rank 0's, so Ray sets ASCEND_RT_VISIBLE_DEVICES in each; here Ray is told it has 3 NPUs
    and probes stand in for the actors (the placement, not the actors, is under test)."""
    ray = pytest.importorskip("ray")
    from aspc.drivers.ray.runtime import RayRuntime

    source = tmp_path / "npu.aspl"
    source.write_text(NPU_PIPELINE)
    plan = compile_with_passes(source, ["schedule.staleness=0"]).plan()
    assert plan.pool("cpu").hardware == "910b3"
    ray.shutdown()
    ray.init(num_cpus=2, resources={"NPU": 3}, include_dashboard=False, log_to_driver=False)
    try:
        runtime = RayRuntime(plan, ROOT / "pipelines", RunOptions(steps=1, warmstart_steps=0), CpuExecutors)
        runtime.gen_workers = [None, None]  # two instances of one NPU each, then the learner
        runtime.placement = runtime._placement_group()
        probe = ray.remote(lambda: os.environ.get("ASCEND_RT_VISIBLE_DEVICES"))
        visible = ray.get([probe.options(**runtime._bundle(i)).remote() for i in range(3)], timeout=120)
        assert sorted(visible) == ["0", "1", "2"]  # one NPU each, none shared
    finally:
        ray.shutdown()


# ---- `aspc run --backend ascend`: the AscendExecutors factory behind the CLI, with fakes of the platform ----
class CpuLearnerAsLeader:
    """The CPU learner where rank 0's MegatronTrainer would be (megatron's forward does not run on a
    CPU): the same Trainer calls; its weights leave through the trainer's WeightSender."""

    def __init__(self, learner, sender):
        self.learner, self.sender = learner, sender

    def __getattr__(self, name):
        return getattr(self.learner, name)

    def snapshot(self):
        weights = self.learner.snapshot()
        return self.sender.publish(weights.version, weights.state)

    def publish(self, version):
        return self.sender.publish(version, self.learner.actor.state_dict())

    def send_weights(self, version, instance):  # an engine's HandleSender asks (the Ray runtime)
        self.sender.wait(self.sender.start(version, instance))


def fake_platform(monkeypatch):
    """The doctor's checks pass; vLLM is FakeLLM over the CPU generator, the transfer group an
    in-process hub, megatron's rank 0 the CPU learner. Returns the factories the CLI built."""
    from aspc.backends.ascend import executors as npu_executors
    from aspc.backends.ascend.run_executors import AscendExecutors
    from aspc.cli import doctor

    built = []

    def cpu(self):
        if "cpu" not in self.__dict__:
            self.cpu, self.hubs = CpuExecutors(self.plan, self.base_dir, self.seed), {}
            built.append(self)
        return self.cpu

    def engine_api(self, index, instances):
        generator = cpu(self).generation_engine(index, instances)
        comm = ThreadCommunicator(1, self.hubs.setdefault(index, Hub()))
        return SimpleNamespace(LLM=lambda **args: FakeLLM(generator, comm, **args), SamplingParams=SamplingParams)

    def build_trainer(self):
        comms = {}  # one trainer-side communicator per group, as the engine side keeps one

        def send(tensors, instance):
            comm = comms.setdefault(instance, ThreadCommunicator(0, self.hubs.setdefault(instance, Hub())))
            send_hf(tensors, comm, [0, 1])

        return CpuLearnerAsLeader(cpu(self).trainer(), WeightSender(send))

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the engines' launch environment stays in this test
    monkeypatch.setattr(doctor, "missing_stack_message", lambda: None)
    monkeypatch.setattr(npu_executors, "require_npu", lambda: None)
    monkeypatch.setattr(AscendExecutors, "check_launch", lambda self: None)  # tiny_grpo has no checkpoint
    monkeypatch.setattr(AscendExecutors, "engine_api", engine_api)
    monkeypatch.setattr(AscendExecutors, "transfer_group", lambda self, engine, index: engine.connect(
        {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2}))
    monkeypatch.setattr(AscendExecutors, "build_trainer", build_trainer)
    return built


def tiny_variant(tmp_path, name: str, *edits: tuple[str, str]):
    """tiny_grpo with each (old, new) text replaced, written to tmp_path/name.aspl."""
    text = TINY.read_text()
    for old, new in edits:
        text = text.replace(old, new)
    path = tmp_path / f"{name}.aspl"
    path.write_text(text)
    return path


def separate_pools(tmp_path):
    """tiny_grpo with generation on a pool of its own (colocated engines are refused: npu_ipc)."""
    return tiny_variant(tmp_path, "tiny_grpo_separate",
                        ("pool cpu = cpu x 2", "pool cpu = cpu x 1\npool rollout = cpu x 2"),
                        ("generate(actor, prompts) on cpu", "generate(actor, prompts) on rollout"))


def cli_metrics(aspc, tmp_path, backend):
    path = tmp_path / f"{backend}.jsonl"
    result = aspc("run", str(separate_pools(tmp_path)), "--backend", backend, "--steps", "2", "--warmstart", "0",
                  "--workers", "threads", "--metrics", str(path), "--set", "schedule.staleness=0")
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in path.read_text().splitlines() if '"trained"' in line]


def test_aspc_run_backend_ascend_drives_the_npu_executors_as_the_cpu_backend(aspc, tmp_path, monkeypatch):
    """The CLI's NPU path (doctor passed): the AscendExecutors factory's VllmEngines and trainer, driven
    by the same controller, train the same samples per step as `--backend cpu`, with the same first
    step; every engine joined the transfer group once and refreshed by the launch plan's calls."""
    built = fake_platform(monkeypatch)
    npu = cli_metrics(aspc, tmp_path, "ascend")
    cpu = cli_metrics(aspc, tmp_path, "cpu")
    assert len(npu) == len(cpu) == 2
    assert [m["trained"] for m in npu] == [m["trained"] for m in cpu]
    for key in ("reward", "response_len", "is_weight"):
        assert npu[0][key] == cpu[0][key], key
    [executors] = built
    assert len(executors.engines) == 2
    for engine in executors.engines.values():
        first, *calls = engine.llm.calls
        assert first == "init_weight_transfer_engine"
        refresh = ["start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache"]
        assert calls and calls == refresh * (len(calls) // 4)


def test_aspc_run_backend_ascend_refuses_what_the_npu_executors_do_not_run(aspc, tmp_path, monkeypatch):
    """Each refusal is one message saying what to do: a warm start, colocated engines on an NPU
    without a trainer rank (at the stage's line), a model without a checkpoint."""
    fake_platform(monkeypatch)
    separate = str(separate_pools(tmp_path))
    result = aspc("run", separate, "--backend", "ascend", "--warmstart", "5", "--steps", "1")
    assert result.exit_code == 1 and "--warmstart 0" in result.output
    result = aspc("run", str(TINY), "--backend", "ascend", "--warmstart", "0", "--steps", "1")
    assert result.exit_code == 1 and "tiny_grpo.aspl:16:7" in result.output and "no trainer rank" in result.output
    monkeypatch.undo()
    from aspc.backends.ascend.run_executors import AscendExecutors

    with pytest.raises(ValueError, match="Hugging Face checkpoint directory"):
        AscendExecutors(compile_with_passes(separate_pools(tmp_path)).plan(), tmp_path)


def test_separate_pool_engines_started_here_take_their_own_npus_not_rank_zeros(tmp_path, monkeypatch):
    """The local runtime starts a separate pool's engines in this process after rank 0 set its one NPU
    (ASCEND_RT_VISIBLE_DEVICES=0): each engine starts with the launch plan's NPUs instead; in Ray's
    actors (engines_in_actors) the NPUs are those Ray's placement gives the actor."""
    from aspc.backends.ascend.run_executors import AscendExecutors

    monkeypatch.setattr(AscendExecutors, "check_launch", lambda self: None)  # tiny_grpo has no checkpoint
    executors = AscendExecutors(compile_with_passes(separate_pools(tmp_path)).plan(), tmp_path)
    monkeypatch.setitem(os.environ, "ASCEND_RT_VISIBLE_DEVICES", "0")  # rank 0's, as build_trainer sets it
    for index in range(2):
        process = next(p for p in executors.launch.processes if p.name == f"gen.{index}.dp0")
        assert executors.engine_env(index)["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, process.devices))
    assert {executors.engine_env(i)["ASCEND_RT_VISIBLE_DEVICES"] for i in range(2)} == {"1", "2"}
    executors.engines_in_actors()
    assert "ASCEND_RT_VISIBLE_DEVICES" not in executors.engine_env(0)


def test_published_weights_reach_an_engine_in_another_ray_actor_through_the_learners_handle():
    """Published inside the actor that holds the trainer's WeightSender, the weights leave it as a
    HandleSender; an engine in another actor starts and waits for its broadcast through that handle
    (the tensors stay staged where they were published), and a failed send raises on the engine's
    side. Outside a Ray actor a sender cannot leave its process."""
    ray = pytest.importorskip("ray")
    import pickle

    from aspc.backends.ascend.weight_sync import HandleSender

    class Learner:  # stands for the driver's learner actor (aspc/drivers/ray/runtime.py: send_weights)
        def __init__(self):
            self.sent = []
            self.sender = WeightSender(self._send)

        def _send(self, tensors, instance):
            if instance < 0:
                raise RuntimeError("broadcast failed")
            self.sent.append((instance, {name: t.tolist() for name, t in tensors.items()}))

        def publish(self, version):
            return self.sender.publish(version, {"w": torch.full((2,), float(version))})

        def send_weights(self, version, instance):
            self.sender.wait(self.sender.start(version, instance))

        def log(self):
            return self.sent

    class Engine:  # stands for a generation actor: the two calls VllmEngine.load_weights makes
        def refresh(self, published, instance):
            published.sender.wait(published.sender.start(published.version, instance))
            return type(published.sender).__name__

    with pytest.raises(TypeError, match="stays on trainer rank 0"):
        pickle.dumps(WeightSender(lambda tensors, instance: None))
    ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        learner, engine = ray.remote(Learner).remote(), ray.remote(Engine).remote()
        published = ray.get(learner.publish.remote(3), timeout=120)
        assert isinstance(published.sender, HandleSender) and published.version == 3
        assert ray.get(engine.refresh.remote(published, 1), timeout=120) == "HandleSender"
        assert ray.get(learner.log.remote()) == [(1, {"w": [3.0, 3.0]})]
        with pytest.raises(ray.exceptions.RayTaskError, match="broadcast failed"):
            ray.get(engine.refresh.remote(published, -1), timeout=120)
    finally:
        ray.shutdown()


# ---- `aspc run --backend ascend --runtime ray`: engines and megatron's rank 0 in Ray actors ----
HUB = "fake-hccl"


class HubActor:
    """fake_comm's Hub in a Ray actor: where each instance's weight-transfer group meets across the
    actors' processes (HCCL's part on NPUs); it also logs which devices each fake process saw."""

    def __init__(self):
        self.hubs, self.log = {}, []

    def exchange(self, instance, key, index, size, value):
        return self.hubs.setdefault(instance, Hub()).exchange(key, index, size, value)

    def note(self, item):
        self.log.append(item)

    def notes(self):
        return self.log


class RemoteHub:
    """Instance `instance`'s group in HubActor, as ThreadCommunicator calls a Hub."""

    def __init__(self, instance):
        self.instance = instance

    def exchange(self, key, index, size, value):
        import ray

        return ray.get(ray.get_actor(HUB).exchange.remote(self.instance, key, index, size, value))


def note(role, instance=None):
    import ray

    ray.get(ray.get_actor(HUB).note.remote((role, instance, os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
                                            os.getpid())))


class RayFakeAscendExecutors(AscendExecutors):
    """fake_platform's fakes as a subclass, so that they travel into the Ray actors: FakeLLM over the
    CPU generator, megatron's rank 0 the CPU learner (built in the learner actor), each transfer group
    a RemoteHub between the learner's actor and the engine's."""

    def check_launch(self):  # the tiny model has no checkpoint; ASPC_NODES is not set
        pass

    def _cpu(self):
        if "cpu" not in self.__dict__:
            self.cpu = CpuExecutors(self.plan, self.base_dir, self.seed)
        return self.cpu

    def engine_api(self, index, instances):
        generator, comm = self._cpu().generation_engine(index, instances), ThreadCommunicator(1, RemoteHub(index))

        def llm(**args):  # called inside the engine's actor, when the engine starts
            note("engine", index)
            return FakeLLM(generator, comm, **args)

        return SimpleNamespace(LLM=llm, SamplingParams=SamplingParams)

    def build_trainer(self):
        note("learner")
        return CpuLearnerAsLeader(self._cpu().trainer(), WeightSender(self._send))

    def join_trainer_side(self, index):
        self.groups[index] = ThreadCommunicator(0, RemoteHub(index))

    def _send(self, tensors, instance):
        send_hf(tensors, self.groups[instance], [0, 1])


def test_aspc_run_backend_ascend_on_ray_places_engines_and_the_learner_on_npus(aspc, tmp_path, monkeypatch):
    """`--runtime ray` with the NPU executors: each engine and the learner (built inside its actor,
    version 0 published there) is an actor on its own fake NPU; the transfer groups form between
    the actors; the same controller trains the same samples per step as `--backend cpu`, with the
    same first-step reward."""
    ray = pytest.importorskip("ray")
    from aspc.backends.ascend import executors as npu_executors
    from aspc.backends.ascend import run_executors
    from aspc.cli import doctor

    monkeypatch.setattr(doctor, "missing_stack_message", lambda: None)
    monkeypatch.setattr(npu_executors, "require_npu", lambda: None)
    monkeypatch.setattr(run_executors, "AscendExecutors", RayFakeAscendExecutors)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    npu = tmp_path / "npu.aspl"
    npu.write_text(separate_pools(tmp_path).read_text().replace("= cpu x", "= 910b3 x"))
    ray.shutdown()
    ray.init(num_cpus=2, resources={"NPU": 3}, include_dashboard=False, log_to_driver=False)
    try:
        hub = ray.remote(HubActor).options(name=HUB, num_cpus=0, max_concurrency=16).remote()
        path = tmp_path / "ray.jsonl"
        result = aspc("run", str(npu), "--backend", "ascend", "--runtime", "ray", "--steps", "2", "--warmstart",
                      "0", "--metrics", str(path), "--set", "schedule.staleness=0")
        assert result.exit_code == 0, result.output
        notes = ray.get(hub.notes.remote())
    finally:
        ray.shutdown()
    on_ray = [json.loads(line) for line in path.read_text().splitlines() if '"trained"' in line]
    cpu = cli_metrics(aspc, tmp_path, "cpu")
    assert len(on_ray) == len(cpu) == 2
    assert [m["trained"] for m in on_ray] == [m["trained"] for m in cpu]
    for key in ("reward", "response_len"):  # the first step: the same responses from the same weights
        assert on_ray[0][key] == cpu[0][key], key
    assert on_ray[0]["is_weight"] == pytest.approx(cpu[0]["is_weight"], abs=1e-6)  # engines' log-probs
    roles = sorted((role, instance) for role, instance, _, _ in notes)
    assert roles == [("engine", 0), ("engine", 1), ("learner", None)]
    assert sorted(devices for _, _, devices, _ in notes) == ["0", "1", "2"]  # one fake NPU each
    assert len({pid for *_, pid in notes} | {os.getpid()}) == 4  # three actors, none of them this process


# ---- colocated (time-shared) pools on NPUs: offload and onload, sleep and wake, the NPU IPC refresh ----
class IpcFakeLLM(FakeLLM):
    """FakeLLM as a colocated engine: no transfer group to join; `update_weights` takes the chunks
    that trainer rank 0 delivers during the NPU IPC send (here `ipc_handles` carry the tensors
    themselves, as rebuild_npu_tensor maps the trainer's memory). Every call goes to the run's log."""

    def __init__(self, log, generator, **engine_args):
        super().__init__(generator, None, **engine_args)
        self.calls = log
        self.env = {k: os.environ.get(k) for k in ("VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_ASCEND_ENABLE_NZ")}

    def _add_request(self, request_id, prompt, params):
        self.calls.append("generate")
        super()._add_request(request_id, prompt, params)

    def init_weight_transfer_engine(self, request):
        assert request == {"init_info": {}}  # NPUIPCWeightTransferInitInfo has no fields
        self.calls.append("init_weight_transfer_engine")

    def update_weights(self, request):
        info = request["update_info"]
        self.calls.append("update_weights")
        self.received.update(zip(info["names"], info["ipc_handles"]))


def ipc_send(tensors, deliver):
    """The NPU IPC send of one rank (npu_ipc_sender) on a CPU: two chunks, delivered in order."""
    names = sorted(tensors)
    for chunk in (names[:len(names) // 2], names[len(names) // 2:]):
        deliver({"names": chunk, "dtype_names": [str(tensors[n].dtype) for n in chunk],
                 "shapes": [list(tensors[n].shape) for n in chunk], "ipc_handles": [tensors[n] for n in chunk],
                 "packed": False})


class ColocatedLeader(CpuLearnerAsLeader):
    """The CPU learner as rank 0 on a time-shared pool: offload, onload and each train call logged."""

    def __init__(self, learner, sender, log):
        super().__init__(learner, sender)
        self.log = log

    def offload(self):
        self.log.append("offload")

    def onload(self):
        self.log.append("onload")

    def train(self, rollouts):
        if self.log[-1] != "train":
            self.log.append("train")
        self.learner.train(rollouts)


def fake_colocated_platform(monkeypatch, llm=None, send=None):
    """fake_platform with colocated engines and the CPU learner behind an IpcSender; one log of the
    engines' and the learner's calls per factory. `llm(log, index, generator, **args)`: an engine's
    fake vLLM (IpcFakeLLM); `send(factory)`: the ranks' NPU IPC send (ipc_send)."""
    from aspc.backends.ascend.weight_sync import IpcSender

    built = fake_platform(monkeypatch)
    llm = llm or (lambda log, index, generator, **args: IpcFakeLLM(log, generator, **args))

    def cpu(self):
        if "cpu" not in self.__dict__:
            self.cpu, self.log = CpuExecutors(self.plan, self.base_dir, self.seed), []
            built.append(self)
        return self.cpu

    def engine_api(self, index, instances):
        generator = cpu(self).generation_engine(index, instances)
        return SimpleNamespace(LLM=lambda **args: llm(self.log, index, generator, **args),
                               SamplingParams=SamplingParams)

    def build_trainer(self):
        return ColocatedLeader(cpu(self).trainer(), IpcSender(send(self) if send else ipc_send), self.log)

    monkeypatch.setattr(AscendExecutors, "engine_api", engine_api)
    monkeypatch.setattr(AscendExecutors, "build_trainer", build_trainer)
    return built


def one_engine(tmp_path):
    """tiny_grpo with one generation instance: its NPU then holds the trainer's rank (NPU IPC needs it)."""
    path = tmp_path / "tiny_grpo_colocated.aspl"
    path.write_text(TINY.read_text().replace("instances = 2,", "instances = 1,"))
    return path


def two_step_metrics(aspc, path, backend, metrics):
    result = aspc("run", str(path), "--backend", backend, "--steps", "2", "--warmstart", "0", "--workers", "threads",
                  "--metrics", str(metrics), "--set", "schedule.staleness=0")
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"trained"' in line]


def npu_trains_as_cpu(aspc, path, tmp_path) -> tuple[list, list]:
    """Two steps of `path` on each backend: the same samples per step and the same first reward;
    their metrics rows."""
    npu = two_step_metrics(aspc, path, "ascend", tmp_path / "npu.jsonl")
    cpu = two_step_metrics(aspc, path, "cpu", tmp_path / "cpu.jsonl")
    assert len(npu) == len(cpu) == 2
    assert [m["trained"] for m in npu] == [m["trained"] for m in cpu]
    assert npu[0]["reward"] == cpu[0]["reward"]
    return npu, cpu


def steps_of(log):
    """The log with each run of repeated calls (decode steps, per-chunk updates) as one entry."""
    return [call for i, call in enumerate(log) if i == 0 or call != log[i - 1]]


REFRESH = ["wake_up(['weights'])", "start_weight_update", "update_weights", "finish_weight_update",
           "wake_up(['kv_cache'])", "reset_prefix_cache"]


def test_aspc_run_backend_ascend_switches_a_time_shared_pool_between_engines_and_trainer(aspc, tmp_path,
                                                                                         monkeypatch):
    """A colocated plan under `--backend ascend`: the same controller trains the same samples per
    step as `--backend cpu`; each switch to generation offloads the trainer before the engine wakes
    (weights, the NPU IPC refresh, then its KV cache) and generates, and each switch to training
    puts the engine to sleep before the trainer onloads and trains."""
    built = fake_colocated_platform(monkeypatch)
    npu_trains_as_cpu(aspc, one_engine(tmp_path), tmp_path)
    [executors] = built
    log = steps_of(executors.log)
    # the engine starts and sleeps before the trainer builds (the launch plan's start-up order on shared
    # NPUs); generation has the pool first, so the trainer offloads and the engine wakes into version 0
    start = ["sleep(1)", "offload", "init_weight_transfer_engine", *REFRESH, "generate"]
    learn = ["sleep(1)", "onload", "train"]
    assert log == start + learn + ["offload", *REFRESH, "generate"] + learn, log  # the last version is not synced
    assert executors.log.count("update_weights") == 2 * 2  # two refreshes of two IPC chunks each
    engine = executors.engines[0]
    assert engine.llm.env == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_ASCEND_ENABLE_NZ": "0"}
    loaded, published = engine.llm.generator.model.state_dict(), executors.learner.sender.staged.get(1)
    assert engine.version == 1 and all(torch.equal(loaded[name], t) for name, t in published.items())


def test_colocated_plans_the_npu_ipc_path_cannot_run_are_refused_at_the_generate_stage(tmp_path):
    """Engines beyond this node on the local runtime; on Ray they run (tests/test_ray_colocated.py),
    and tests/test_ascend_colocated.py has the rest."""
    from aspc.backends.ascend.run_executors import AscendExecutors

    plan = compile_with_passes(one_engine(tmp_path), ["schedule.staleness=0"]).plan()
    assert AscendExecutors.unsupported(plan) == [] == AscendExecutors.unsupported(plan, "ray")
    two = compile_with_passes(ROOT / "pipelines" / "grpo_7b_colocated.aspl").plan()
    assert [r.option for r in AscendExecutors.unsupported(two)] == ["instances"]  # node 1's engines
    assert AscendExecutors.unsupported(two, "ray") == []  # an engine actor on each node


def test_every_rank_holds_the_whole_hf_model_for_the_engine_worker_on_its_npu():
    """Colocated refresh (npu_ipc): each rank of a TP2·PP2 trainer assembles the whole Hugging Face
    checkpoint by the in-place reshard with an inference tensor-parallel size of 1."""
    from aspc.backends.ascend import reshard
    from aspc.backends.ascend.weight_sync import coords_of, whole_hf_in_place
    from aspc.ir.facts import ModelArch
    from aspc.ir.graph import Parallel
    from fake_comm import run_ranks

    arch = ModelArch(layers=4, hidden=16, heads=8, kv_heads=4, head_dim=2, ffn=32, vocab=64, qkv_bias=True)
    par, generator = Parallel(tp=2, pp=2), torch.Generator().manual_seed(3)
    full = {name: torch.randn(shape, generator=generator) for name, shape in reshard.full_shapes(arch).items()}
    shards = [reshard.shard_state(arch, full, par.tp, par.pp, par.ep, coords_of(par, r)) for r in range(par.devices)]
    hf = reshard.to_hf(arch, full)
    for whole in run_ranks(par.devices, lambda comm: dict(whole_hf_in_place(arch, shards[comm.rank], par, comm))):
        assert sorted(whole) == sorted(hf) and all(torch.equal(whole[name], hf[name]) for name in hf)


def test_an_engine_that_stops_taking_chunks_fails_the_ipc_send_instead_of_blocking_it():
    from aspc.backends.ascend.weight_sync import IpcSender

    sender = IpcSender(ipc_send)
    published = sender.publish(1, {"a": torch.zeros(2), "b": torch.ones(2)})
    pending = sender.start(published.version, 0)
    updates = sender.updates(pending)
    assert next(updates)["names"] == ["a"]
    updates.close()  # the engine's update_weights raised after the first chunk
    with pytest.raises(RuntimeError, match="stopped taking weight chunks"):
        sender.wait(pending)
