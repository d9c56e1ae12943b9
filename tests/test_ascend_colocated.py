"""Colocated (time-shared) pools on NPUs with several engines, and a refresh that no rank assembles:
CPU fakes of vLLM's offline API and of vllm-ascend's NPU IPC engine (test_ascend_executors.py),
the CPU learner in megatron rank 0's place, threads for the trainer's ranks (fake_comm.py)."""
import dataclasses
import os
import weakref

import pytest
import torch

from aspc.backends.ascend import reshard
from aspc.backends.ascend.hf_stream import HfStream, stream_peak_bytes
from aspc.backends.ascend.run_executors import AscendExecutors
from aspc.backends.ascend.weight_sync import coords_of, reshard_in_place
from aspc.ir.facts import ModelArch
from aspc.ir.graph import Parallel
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from fake_comm import run_ranks
from test_ascend_executors import (REFRESH, TINY, IpcFakeLLM, fake_colocated_platform, npu_trains_as_cpu,
                                   steps_of)


# ---- several engines on one time-shared pool ----
class Tagged(list):
    """An engine's calls, written into the run's log as "instance:call"."""

    def __init__(self, log, instance):
        super().__init__()
        self.log, self.instance = log, instance

    def append(self, call):
        self.log.append(f"{self.instance}:{call}")


class PlacedIpcLLM(IpcFakeLLM):
    """A colocated engine that knows its NPUs as vllm-ascend's NPU IPC engine does
    (npu_generate_uuid: the host and the physical chip behind ASCEND_RT_VISIBLE_DEVICES, read when
    the engine's processes start) and loads each chunk from the handle of its own chip only."""

    def __init__(self, log, instance, generator, **engine_args):
        super().__init__(log, generator, **engine_args)
        self.calls = Tagged(log, instance)
        self.chips = {f"node0-{d}" for d in os.environ["ASCEND_RT_VISIBLE_DEVICES"].split(",")}
        self.read: set[str] = set()

    def update_weights(self, request):
        info = request["update_info"]
        self.calls.append("update_weights")
        for chip in self.chips:
            sender_chip, tensors = info["ipc_handles"][chip]
            self.read.add(sender_chip)
            self.received.update({name: tensors[name] for name in info["names"]})


def all_ranks_send(chips):
    """The NPU IPC send of every trainer rank at once (handles all-gathered, rank 0 delivers): each
    chunk's handle per chip is what the trainer rank on that chip shares."""

    def send(tensors, deliver):
        names = sorted(tensors)
        for chunk in (names[:len(names) // 2], names[len(names) // 2:]):
            handles = {chip: (chip, {n: tensors[n] for n in chunk}) for chip in chips}
            deliver({"names": chunk, "dtype_names": [str(tensors[n].dtype) for n in chunk],
                     "shapes": [list(tensors[n].shape) for n in chunk], "ipc_handles": handles, "packed": True})

    return send


def trainer_chips(executors) -> list[str]:
    return [f"node{p.node}-{d}" for p in executors.launch.processes if p.stage == executors.train_stage.name
            for d in p.env["ASCEND_RT_VISIBLE_DEVICES"].split(",")]


def two_engine_platform(monkeypatch):
    """Each engine's fake vLLM placed on its NPU (PlacedIpcLLM); every trainer rank sends its chip's chunks."""
    return fake_colocated_platform(monkeypatch, llm=PlacedIpcLLM, send=lambda self: all_ranks_send(trainer_chips(self)))


def two_engines(tmp_path):
    """tiny_grpo's two instances (NPU 0 and NPU 1) and a trainer with a rank on each of them."""
    path = tmp_path / "tiny_grpo_two_colocated.aspl"
    path.write_text(TINY.read_text().replace("loss = grpo, lr = 3e-4", "dp = 2, loss = grpo, lr = 3e-4"))
    return path


def engine_calls(log, instance) -> list[str]:
    return steps_of([entry.split(":", 1)[1] for entry in log if entry.startswith(f"{instance}:")])


def test_two_engines_on_one_pool_sleep_wake_and_refresh_each_from_the_ranks_on_their_npus(aspc, tmp_path,
                                                                                         monkeypatch):
    """Both engines start (each on its own NPU) and sleep before the trainer builds; every switch to
    generation offloads the trainer before any engine wakes, and each engine then wakes its
    weights, loads the chunks of the trainer rank on its own NPU, wakes its KV cache and generates;
    every switch to training sleeps both engines before the trainer onloads. The same samples per
    step as `--backend cpu`."""
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    built = two_engine_platform(monkeypatch)
    npu_trains_as_cpu(aspc, two_engines(tmp_path), tmp_path)
    [executors] = built
    log = executors.log
    for instance in (0, 1):
        assert engine_calls(log, instance) == ["sleep(1)", "init_weight_transfer_engine", *REFRESH, "generate",
                                               "sleep(1)", *REFRESH, "generate", "sleep(1)"], (instance, log)
    trainer = [entry for entry in steps_of(log) if ":" not in entry]
    assert trainer == ["offload", "onload", "train", "offload", "onload", "train"]
    for at, entry in enumerate(log):
        switches = [e for e in log[:at] if e in ("offload", "onload")]
        if entry.endswith("wake_up(['weights'])"):  # an engine wakes only after the trainer offloaded
            assert switches and switches[-1] == "offload", log
        if entry == "onload":  # the trainer onloads only when both engines sleep
            for instance in (0, 1):
                assert [e for e in log[:at] if e.startswith(f"{instance}:")][-1] == f"{instance}:sleep(1)", log
    engines = [executors.engines[i].llm for i in (0, 1)]
    assert [e.read for e in engines] == [{"node0-0"}, {"node0-1"}]  # only the rank on the engine's own NPU
    assert [e.chips for e in engines] == [{"node0-0"}, {"node0-1"}]
    assert "ASCEND_RT_VISIBLE_DEVICES" not in os.environ  # set only while each engine started
    published = executors.learner.sender.staged.get(1)
    for engine in engines:
        loaded = engine.generator.model.state_dict()
        assert all(torch.equal(loaded[name], t) for name, t in published.items())


# ---- the streamed refresh: one bucket, never the whole model ----
DENSE = ModelArch(layers=4, hidden=16, heads=8, kv_heads=4, head_dim=2, ffn=32, vocab=64, qkv_bias=True, qk_norm=True)
MOE = ModelArch(layers=4, hidden=16, heads=4, kv_heads=4, head_dim=4, ffn=32, vocab=64, experts=8, top_k=2,
                expert_ffn=8, dense_layers=1, qk_norm=True)
MLA_MOE = ModelArch(layers=7, hidden=16, heads=4, kv_heads=4, head_dim=6, ffn=32, vocab=64, attention="mla",
                    q_lora_rank=8, kv_lora_rank=6, qk_rope_dim=2, v_head_dim=4, experts=8, top_k=2, expert_ffn=8,
                    shared_experts=1, dense_layers=1)


class PackedProducer:
    """vllm-ascend's packed_npu_ipc_producer on a CPU: one reused buffer of `bucket` bytes filled from
    the iterator and handed over when full; it records the most bytes of streamed tensors alive at
    once (weak references: what the stream still holds after the buffer took its copy)."""

    def __init__(self, bucket: int):
        self.bucket, self.buffer = bucket, torch.empty(bucket, dtype=torch.uint8)
        self.alive, self.peak, self.chunks = 0, 0, []

    def _track(self, tensor):
        size = tensor.numel() * tensor.element_size()
        self.alive += size
        weakref.finalize(tensor, self._freed, size)
        self.peak = max(self.peak, self.alive)

    def _freed(self, size):
        self.alive -= size

    def send(self, iterator):
        names, used = [], 0
        for name, tensor in iterator:
            self._track(tensor)
            flat = tensor.contiguous().view(torch.uint8).view(-1)
            assert flat.numel() <= self.bucket, name
            if used + flat.numel() > self.bucket:
                self._hand_over(names, used)
                names, used = [], 0
            self.buffer[used:used + flat.numel()].copy_(flat)
            names.append((name, tensor.shape, tensor.dtype, used))
            used += flat.numel()
            del tensor, flat
        self._hand_over(names, used)

    def _hand_over(self, names, used):
        """The engine's side (packed_npu_ipc_consumer): a clone of each tensor of the chunk."""
        chunk = {}
        for name, shape, dtype, offset in names:
            size = torch.Size(shape).numel() * dtype.itemsize
            chunk[name] = self.buffer[offset:offset + size].clone().view(dtype).view(shape)
        self.chunks.append(chunk)

    def received(self) -> dict:
        return {name: t for chunk in self.chunks for name, t in chunk.items()}


def rank_states(arch, full, par, layout):
    return [reshard.shard_state(arch, full, par.tp, par.pp, par.ep, coords_of(par, r), layout)
            for r in range(par.devices)]


@pytest.mark.parametrize("arch,layout,par", [
    (DENSE, reshard.PLAIN, Parallel(tp=2, pp=2)),
    (MLA_MOE, reshard.Layout(last_stage_layers=4, expert_bias=True), Parallel(tp=2, pp=2, dp=2, ep=2)),
], ids=["dense-tp2-pp2", "uneven-mla-moe-tp2-pp2-dp2-ep2"])
def test_a_bucketed_stream_reassembles_the_whole_model_path_while_holding_one_bucket(arch, layout, par):
    """Every rank streams the model through its own bucket; what the engine on each NPU reassembles
    from the chunks equals, tensor for tensor, what the whole-model path (the in-place reshard to
    one inference rank, in Hugging Face names) assembles; no more than one bucket of streamed
    tensors is ever alive on a rank, and the whole model would be (the control)."""
    generator = torch.Generator().manual_seed(5)
    full = {n: torch.randn(s, generator=generator) for n, s in reshard.full_shapes(arch, layout).items()}
    states = rank_states(arch, full, par, layout)
    whole = reshard.to_hf(arch, full, layout)
    model_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    bucket = model_bytes // 8
    expected = run_ranks(par.devices, lambda comm: reshard.to_hf(
        arch, reshard_in_place(arch, states[comm.rank], par, 1, comm, layout), layout))

    def stream(comm):
        producer = PackedProducer(bucket)
        producer.send(iter(HfStream(arch, states[comm.rank], par, comm, layout).on_host()))
        return producer

    producers = run_ranks(par.devices, stream)
    for producer, assembled in zip(producers, expected):
        got = producer.received()
        assert sorted(got) == sorted(assembled) == sorted(whole)
        assert all(torch.equal(got[name], assembled[name]) for name in whole)
        assert 0 < producer.peak <= bucket < model_bytes and len(producer.chunks) >= 8
    control = PackedProducer(bucket)
    control.send(iter(whole.items()))  # the whole model at once: every tensor stays alive
    assert control.peak == model_bytes > bucket


def test_every_rank_streams_the_same_names_in_the_same_order_as_the_update_info_says():
    """Rank 0's chunk descriptions hold for every rank's buffer only if all ranks stream alike."""
    arch, layout = MLA_MOE, reshard.Layout(last_stage_layers=4, expert_bias=True)
    par = Parallel(tp=2, pp=2, dp=2, ep=2)
    generator = torch.Generator().manual_seed(6)
    full = {n: torch.randn(s, generator=generator) for n, s in reshard.full_shapes(arch, layout).items()}
    states = rank_states(arch, full, par, layout)
    orders = run_ranks(par.devices, lambda comm: [
        (n, list(t.shape)) for n, t in HfStream(arch, states[comm.rank], par, comm, layout)])
    info = HfStream(arch, states[0], par, None, layout).update_info()
    assert all(order == list(zip(info["names"], info["shapes"])) for order in orders)


def test_the_refresh_peak_counts_two_buckets_and_the_largest_gather():
    """The IPC buffer (widened to the largest tensor), the engine's copy of a chunk, and the
    parameter being gathered (an expert from every expert-parallel rank)."""
    par = Parallel(tp=2, ep=2)
    largest = max(torch.Size(s).numel() for s in reshard.full_shapes(MOE).values()) * 2
    assert stream_peak_bytes(MOE, 2, par, 1 << 30) == 2 * (1 << 30) + 3 * largest
    assert stream_peak_bytes(MOE, 2, par, 1) == 2 * largest + 3 * largest


# ---- what stays refused, at the stage and option ----
def plan_of(name):
    return compile_with_passes(ROOT / "pipelines" / f"{name}.aspl").plan()


def test_colocated_engines_beyond_this_node_are_refused_at_their_option():
    """grpo_7b_colocated's 16 NPUs span two nodes (the local runtime starts engines on this one), and
    so do r1_zero_671b's; on Ray each engine (each data-parallel rank of r1's instances:
    tests/test_ray_colocated.py) is an actor on its node. Its refresh fits: no rank assembles the
    1250 GiB model any more."""
    [nodes] = AscendExecutors.unsupported(plan_of("grpo_7b_colocated"))
    assert (nodes.stage, nodes.option) == ("gen", "instances") and "node(s) 1:" in nodes.message
    assert "--runtime ray" in nodes.hint
    [big] = AscendExecutors.unsupported(plan_of("r1_zero_671b"))
    assert (big.stage, big.option) == ("gen", "instances") and "node(s) 1-47" in big.message
    assert AscendExecutors.unsupported(plan_of("r1_zero_671b"), "ray") == []


def test_a_refresh_that_does_not_fit_beside_the_engines_weights_is_refused_with_its_numbers(monkeypatch,
                                                                                          tmp_path):
    from aspc.backends.ascend import engine_args

    path = tmp_path / "one_node.aspl"
    text = (ROOT / "pipelines" / "grpo_7b_colocated.aspl").read_text().replace("910b3 x 16", "910b3 x 8")
    path.write_text(text.replace("instances = 4", "instances = 2").replace("dp = 4", "dp = 2"))
    plan = compile_with_passes(path).plan()
    assert AscendExecutors.unsupported(plan) == []  # two engines on one node: runs
    monkeypatch.setattr(engine_args, "WEIGHT_BUCKET_BYTES", 40 << 30)
    [memory] = AscendExecutors.unsupported(plan)
    assert (memory.stage, memory.option) == ("gen", "placement")
    assert "a colocated refresh needs" in memory.message and "64 GiB" in memory.message


def test_partial_rollout_on_a_time_shared_pool_is_refused_on_the_npu_path():
    """Carry-over pauses requests in flight over the learner's turn (docs/simulator.md): a sleeping
    vllm-ascend engine would drop their KV cache, so the NPU path refuses it at the generate stage."""
    plan = compile_with_passes(ROOT / "pipelines" / "r1_zero_671b.aspl", ["schedule.partial_rollout=1"]).plan()
    [refused] = AscendExecutors.unsupported(plan, "ray")
    assert (refused.stage, refused.option) == ("gen", None) and "partial rollout" in refused.message
    assert "give generation a pool of its own" in refused.hint


def test_the_tiny_layout_refusal_names_the_npu_without_a_trainer_rank():
    """tiny_grpo trains on one device while its second engine sits on device 1: no trainer rank
    there to share the weights (vllm-ascend's NPU IPC handles are per chip)."""
    [refused] = AscendExecutors.unsupported(compile_with_passes(TINY).plan())
    assert refused.option == "placement" and "devices [1]" in refused.message


def test_an_engines_placement_is_set_only_while_it_starts():
    from aspc.backends.ascend.engine_actor import PLACEMENT_ENV, engine_environment

    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,5", "VLLM_ASCEND_ENABLE_NZ": "0"}
    before = dict(os.environ)
    try:
        with engine_environment(env, PLACEMENT_ENV):
            assert os.environ["ASCEND_RT_VISIBLE_DEVICES"] == "4,5"
        assert os.environ.get("ASCEND_RT_VISIBLE_DEVICES") == before.get("ASCEND_RT_VISIBLE_DEVICES")
        assert os.environ["VLLM_ASCEND_ENABLE_NZ"] == "0"  # vLLM reads it in this process too
    finally:
        os.environ.clear()
        os.environ.update(before)


def test_the_bucket_is_a_launch_plan_setting_the_send_widens_to_the_largest_tensor():
    from aspc.backends.ascend.engine_args import WEIGHT_BUCKET_BYTES
    from aspc.backends.ascend.executors import bucket_bytes
    from aspc.backends.ascend.lowering import lower

    launch = dataclasses.asdict(lower(plan_of("grpo_7b_colocated"), ROOT / "pipelines"))
    assert bucket_bytes(launch) == WEIGHT_BUCKET_BYTES == 1 << 30


# ---- conformance: what the streamed send hands vllm-ascend's NPU IPC engine ----
def send_argument_keys(source: str) -> set[str]:
    """The keys of the dict that executors.npu_ipc_sender passes as trainer_send_weights' trainer_args."""
    import ast

    found = set()
    [sender] = [n for n in ast.walk(ast.parse(source)) if getattr(n, "name", "") == "npu_ipc_sender"]
    for node in ast.walk(sender):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "trainer_send_weights":
            found |= {k.value for k in node.args[1].keys if isinstance(k, ast.Constant)}
    return found


def npu_ipc_send_fields(vllm, vllm_ascend) -> set[str]:
    from wheel_sources import dataclass_fields

    return (dataclass_fields(vllm, "vllm.distributed.weight_transfer.ipc_engine", "IPCTrainerSendWeightsArgs")
            | dataclass_fields(vllm_ascend, "vllm_ascend.distributed.weight_transfer.npu_ipc_engine",
                               "NPUIPCTrainerSendWeightsArgs"))


def test_the_streamed_send_passes_only_npu_ipc_send_fields_and_the_default_bucket_is_vllm_ascends():
    """Read from the real wheels: every key npu_ipc_sender's trainer_args hold is a field of
    NPUIPCTrainerSendWeightsArgs (and its vLLM base); a renamed key fails; the launch plan's
    default bucket is vllm-ascend's DEFAULT_PACKED_BUFFER_SIZE_BYTES."""
    import ast

    from aspc.backends.ascend.engine_args import WEIGHT_BUCKET_BYTES
    from test_ascend_conformance import wheel
    from wheel_sources import Sources

    vllm = Sources.from_wheel(wheel("ASPC_VLLM_WHEEL", "vllm==0.23.0"), ("vllm",))
    vllm_ascend = Sources.from_wheel(wheel("ASPC_VLLM_ASCEND_WHEEL", "vllm-ascend==0.23.0", "manylinux_2_34_x86_64"),
                                     ("vllm_ascend",))
    fields = npu_ipc_send_fields(vllm, vllm_ascend)
    source = (ROOT / "backends" / "ascend" / "executors.py").read_text()
    keys = send_argument_keys(source)
    assert keys == {"send_mode", "packed", "packed_buffer_size_bytes"} and keys <= fields
    renamed = send_argument_keys(source.replace('"packed_buffer_size_bytes"', '"packed_buffer_bytes"'))
    assert renamed - fields == {"packed_buffer_bytes"}
    tree = vllm_ascend.tree("vllm_ascend.distributed.weight_transfer.packed_tensor")
    [default] = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "DEFAULT_PACKED_BUFFER_SIZE_BYTES"]
    assert eval(compile(ast.Expression(default), "packed_tensor", "eval")) == WEIGHT_BUCKET_BYTES
