"""Hugging Face checkpoints into the NPU trainer's megatron models (backends/ascend/load_hf.py), on CPU:
a tiny random Qwen2/Qwen3-style safetensors checkpoint loaded into megatron-core GPTModels built from
the lowered tiny_grpo train stage (one rank, gloo), a pipeline stage's model built for that stage, and
the tensor-, pipeline- and expert-parallel selections against reshard.shard_state."""
import copy
import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from aspc.backends.ascend import reshard
from aspc.backends.ascend.lowering import lower
from aspc.backends.ascend.megatron_model import arch_of
from aspc.backends.ascend.weight_sync import coords_of
from aspc.ir.graph import Parallel
from conftest import ROOT
from test_ascend_executors import one_rank, tiny_plan  # noqa: F401 (a fixture)
from test_reshard import MOE

pytest.importorskip("megatron.core")

from aspc.backends.ascend.load_hf import CheckpointError, LazyCheckpoint, load_rank_weights, rank_tensors  # noqa: E402


def train_stage(qwen3: bool = False) -> dict:
    """tiny_grpo's lowered train stage as a Qwen2 (qkv bias, untied) or Qwen3 (q/k norm, tied) model."""
    launch = lower(tiny_plan(), ROOT / "pipelines")
    stage = copy.deepcopy(dataclasses.asdict(next(s for s in launch.stages if s.kind == "train")))
    stage["config"]["add_qkv_bias"] = not qwen3
    stage["config"]["qk_layernorm"] = stage["builders"]["layer_spec"]["arguments"]["qk_layernorm"] = qwen3
    stage["model_args"]["share_embeddings_and_output_weights"] = qwen3
    return stage


def random_full(arch, layout=reshard.PLAIN, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in reshard.full_shapes(arch, layout).items()}


def write_checkpoint(folder, hf: dict, shards: int = 1) -> None:
    """safetensors files as Hugging Face writes them (several with an index when `shards` > 1)."""
    import json

    names = sorted(hf)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = names[i::shards]
        save_file({n: hf[n].contiguous() for n in part}, str(folder / file))
        weight_map |= {n: file for n in part}
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("qwen3", [False, True], ids=["qwen2", "qwen3"])
def test_every_parameter_of_a_one_rank_model_is_the_mapped_checkpoint_tensor(one_rank, tmp_path, qwen3):  # noqa: F811
    from aspc.backends.ascend.megatron_model import build_gpt, load_checkpoint

    stage = train_stage(qwen3)
    arch = arch_of(stage)
    full = random_full(arch, seed=3)
    skipped = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),  # old checkpoints' buffers
               f"model.layers.{arch.layers}.eh_proj.weight": torch.ones(2)}  # past the last layer: DeepSeek's MTP
    hf = reshard.to_hf(arch, full) | skipped
    write_checkpoint(tmp_path, hf, shards=2 if qwen3 else 1)
    model = load_checkpoint(build_gpt(stage, {"pre_process": True, "post_process": True},
                                      use_cpu_initialization=True), stage, str(tmp_path))
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert sorted(state) == sorted(full)
    for name, tensor in state.items():
        assert torch.equal(tensor, full[name]), name


def test_the_critic_body_loads_and_its_value_head_stays_fresh(one_rank, tmp_path):  # noqa: F811
    from aspc.backends.ascend.critic import value_model
    from aspc.backends.ascend.megatron_model import load_checkpoint

    stage = train_stage()
    arch = arch_of(stage)
    full = random_full(arch, seed=4)
    write_checkpoint(tmp_path, reshard.to_hf(arch, full))  # a causal LM: lm_head.weight is left unread
    model = value_model(stage, {"pre_process": True, "post_process": True}, use_cpu_initialization=True)
    head = model.output_layer.weight.detach().clone()
    load_checkpoint(model, stage, str(tmp_path), value_head=True)
    assert torch.equal(model.output_layer.weight, head)
    assert torch.equal(model.decoder.final_layernorm.weight, full["decoder.final_layernorm.weight"])
    assert torch.equal(model.embedding.word_embeddings.weight, full["embedding.word_embeddings.weight"])


def test_a_second_pipeline_stage_model_gets_its_layers_renumbered_and_the_output_layer(one_rank, tmp_path):  # noqa: F811
    """A model built as stage 1 of 2 (one local layer, no embedding) holds global layer 1 as layer 0."""
    from aspc.backends.ascend.megatron_model import build_gpt

    stage = train_stage()
    arch = arch_of(stage)
    full = random_full(arch, seed=5)
    write_checkpoint(tmp_path, reshard.to_hf(arch, full))
    last = copy.deepcopy(stage)
    last["config"]["num_layers"] = 1
    model = build_gpt(last, {"pre_process": False, "post_process": True}, use_cpu_initialization=True)
    load_rank_weights(model, tmp_path, arch, Parallel(pp=2, dp=1), reshard.PLAIN, {"tp": 0, "pp": 1, "ep": 0})
    state = model.state_dict()
    assert torch.equal(state["decoder.layers.0.self_attention.linear_qkv.weight"],
                       full["decoder.layers.1.self_attention.linear_qkv.weight"])
    assert torch.equal(state["output_layer.weight"], full["output_layer.weight"])
    assert "embedding.word_embeddings.weight" not in state


@pytest.mark.parametrize("arch, par", [(None, Parallel(tp=2, pp=2, dp=1)), (MOE, Parallel(tp=2, pp=2, dp=1, ep=2))],
                         ids=["qwen2-tp2-pp2", "moe-tp2-pp2-ep2"])
def test_each_rank_reads_the_shard_megatron_holds(tmp_path, arch, par):
    """Per rank, the loader's tensors are reshard.shard_state's cut of the whole model (TP rank 1's
    interleaved QKV groups and [gate; up] halves, stage 1's renumbered layers, EP rank 1's experts);
    a tied model's last stage gets the embedding as its output layer."""
    arch = arch or dataclasses.replace(arch_of(train_stage()), tied=True)
    full = random_full(arch, seed=6)
    write_checkpoint(tmp_path, reshard.to_hf(arch, full))
    checkpoint = LazyCheckpoint(tmp_path)
    for rank in range(par.devices):
        coords = coords_of(par, rank)
        expected = reshard.shard_state(arch, full, par.tp, par.pp, par.ep, coords)
        if arch.tied and coords["pp"] == par.pp - 1:
            expected["output_layer.weight"] = reshard.split(full["embedding.word_embeddings.weight"],
                                                            reshard.COLUMN, par.tp)[coords["tp"]]
        got = rank_tensors(arch, checkpoint, par, reshard.PLAIN, coords)
        assert sorted(got) == sorted(expected), coords
        for name in got:
            assert torch.equal(got[name], expected[name]), (coords, name)


def test_a_tensor_missing_from_the_checkpoint_is_named_with_the_files(one_rank, tmp_path):  # noqa: F811
    from aspc.backends.ascend.megatron_model import build_gpt, load_checkpoint

    stage = train_stage()
    arch = arch_of(stage)
    hf = reshard.to_hf(arch, random_full(arch))
    del hf["model.layers.1.mlp.up_proj.weight"]
    write_checkpoint(tmp_path, hf)
    model = build_gpt(stage, {"pre_process": True, "post_process": True}, use_cpu_initialization=True)
    with pytest.raises(CheckpointError, match=r"no tensor 'model.layers.1.mlp.up_proj.weight' \(looked in "
                                              r"model.safetensors\)"):
        load_checkpoint(model, stage, str(tmp_path))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_checkpoint(model, stage, str(tmp_path / "nowhere"))


def test_a_checkpoint_of_a_deeper_model_is_refused(one_rank, tmp_path):  # noqa: F811
    """A tensor no parameter is made of (not one of the known extras) says that the checkpoint is
    another model's."""
    from aspc.backends.ascend.megatron_model import build_gpt, load_checkpoint

    stage = train_stage()
    arch = arch_of(stage)
    hf = reshard.to_hf(arch, random_full(arch))
    hf["model.layers.1.mlp.extra.weight"] = torch.ones(2)
    write_checkpoint(tmp_path, hf)
    model = build_gpt(stage, {"pre_process": True, "post_process": True}, use_cpu_initialization=True)
    with pytest.raises(CheckpointError, match=r"no parameter for, e.g. \['model.layers.1.mlp.extra.weight'\]"):
        load_checkpoint(model, stage, str(tmp_path))


def test_the_frozen_reference_loads_the_reference_stages_checkpoint(one_rank, tmp_path, monkeypatch):  # noqa: F811
    """tiny_grpo's reference stage (frozen(actor)) names the checkpoint the trainer's ranks build their
    frozen reference from: eval mode, no gradients, the checkpoint's weights, compiled with the
    reference stage's torchair config (compile_forward, checked against the torch-npu wheel in
    test_torchair_conformance.py; torchair runs on NPUs only, so the call is recorded here); a
    reference of another architecture is refused (it is built on the policy's ranks and layout).
    CPU: weights initialised on CPU."""
    from aspc.backends.ascend import reference_model
    from aspc.backends.ascend.reference_model import frozen_reference, reference_stage

    build = reference_model.build_gpt
    monkeypatch.setattr(reference_model, "build_gpt",
                        lambda stage, args: build(stage, args, use_cpu_initialization=True))
    compiled = []
    monkeypatch.setattr(reference_model, "compile_forward", lambda model, config: compiled.append(config) or model)

    launch = lower(tiny_plan(), ROOT / "pipelines")
    stages = [dataclasses.asdict(s) for s in launch.stages]
    train = next(s for s in stages if s["kind"] == "train")
    found = reference_stage(stages, train)
    assert found is next(s for s in stages if s["kind"] == "reference") and found["compiler"]["mode"] == "max-autotune"
    assert reference_stage([train], train) is None and frozen_reference(train, {}, None) is None
    arch = arch_of(train)
    full = random_full(arch, seed=7)
    write_checkpoint(tmp_path, reshard.to_hf(arch, full))
    reference = frozen_reference(train, {"pre_process": True, "post_process": True},
                                 found | {"builders": found["builders"] | {"checkpoint": str(tmp_path)}})
    assert compiled == [found["compiler"]]
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    fc2 = "decoder.layers.1.mlp.linear_fc2.weight"
    assert torch.equal(reference.state_dict()[fc2], full[fc2])
    deeper = copy.deepcopy(stages)
    next(s for s in deeper if s["kind"] == "reference")["config"]["num_layers"] = 3
    with pytest.raises(ValueError, match="reference model's architecture differs from the policy's"):
        reference_stage(deeper, train)
