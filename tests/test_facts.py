"""Hardware and model facts match shared/FACTS.md; memory estimates follow their formulas."""
import pytest

from aspc.ir.facts import hardware_table, model_presets
from aspc.ir.graph import Parallel
from aspc.ir.memory import USABLE_HBM_FRACTION, generation_need, training_need


@pytest.mark.parametrize("name, total, active, kv_kib", [
    ("qwen2.5-7b", 7.62, 7.62, 56),
    ("qwen2.5-32b", 32.8, 32.8, 256),
    ("qwen3-30b-a3b", 30.5, 3.35, 96),
    ("deepseek-v3", 671.0, 37.6, 68.6),
])
def test_presets_match_published_parameter_counts(name, total, active, kv_kib):
    arch = model_presets()[name]
    assert arch.total_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert arch.active_params() / 1e9 == pytest.approx(active, rel=0.02)
    assert arch.kv_bytes_per_token(2) / 1024 == pytest.approx(kv_kib, rel=0.01)


def test_hardware_table_has_every_pool_kind_with_sources():
    table = hardware_table()
    assert set(table) == {"910b1", "910b2", "910b3", "910b4", "910c", "h100", "h200", "cpu"}
    assert table["910b3"].peak_bf16_tflops == pytest.approx(294.9)
    assert table["910b3"].hbm_gib == 64


def test_32b_generation_on_one_910b3_does_not_fit():
    arch = model_presets()["qwen2.5-32b"]
    need = generation_need(arch, "bf16", Parallel(tp=1), context_tokens=1)
    usable = hardware_table()["910b3"].hbm_bytes * USABLE_HBM_FRACTION
    assert need.parts[0][1] / 1e9 == pytest.approx(65.5, abs=0.1)
    assert usable / 1e9 == pytest.approx(61.8, abs=0.1)
    assert need.total > usable
    assert generation_need(arch, "bf16", Parallel(tp=2), 10_000).total < usable


def test_sharding_lowers_memory_and_distributed_optimizer_helps():
    arch = model_presets()["qwen2.5-7b"]
    one = training_need(arch, "bf16", Parallel(tp=1), True).total
    four = training_need(arch, "bf16", Parallel(tp=4), True).total
    assert four == pytest.approx(one / 4)
    plain = training_need(arch, "bf16", Parallel(tp=4, dp=4), False).total
    sharded = training_need(arch, "bf16", Parallel(tp=4, dp=4), True).total
    assert sharded < plain
    # Megatron: 18 bytes/param without the distributed optimizer
    assert plain == pytest.approx(arch.total_params() / 4 * 18)


def test_expert_parallelism_shards_only_experts():
    arch = model_presets()["qwen3-30b-a3b"]
    dense = generation_need(arch, "bf16", Parallel(tp=1), 1).parts[0][1]
    ep8 = generation_need(arch, "bf16", Parallel(tp=1, dp=8, ep=8), 1).parts[0][1]
    assert ep8 == pytest.approx((arch.dense_params() + arch.expert_params() / 8) * 2)
    assert ep8 < dense


def test_each_device_kind_names_the_ray_resource_it_is_scheduled_as():
    from aspc.ir.facts import hardware_table

    table = hardware_table()
    assert {name: hw.ray_resource for name, hw in table.items() if name.startswith("910")} == \
        {name: "NPU" for name in table if name.startswith("910")}
    assert table["cpu"].ray_resource == "CPU"
    assert {hw.ray_resource for hw in table.values()} <= {"NPU", "GPU", "CPU"}
