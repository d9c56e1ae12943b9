"""The engine/trainer mismatch correction as trainers run it: `auto`'s rule on the measured
sequence ratios, the counts it reads over packed rows as over padded ones, and the CPU learner
correcting fresh samples, reporting the weights and choosing each step's correction from the last.
(The weights and losses themselves are checked against verl in tests/test_losses_verl.py.)"""
import math

import pytest
import torch

from aspc.backends.cpu.executors import CpuExecutors
from aspc.backends.cpu.learner import Learner
from aspc.cli.toolchain import compile_with_passes
from aspc.backends.cpu.model import TinyQwen
from aspc.rl.mismatch import FIRST_AUTO_CHOICE, Mismatch, MismatchCorrection, auto_choice
from conftest import ROOT
from test_off_policy import ARCH, _settings, _stale_rollouts


@pytest.mark.parametrize("sequences, beyond, outside, choice", [
    (0, 0, 0, FIRST_AUTO_CHOICE),  # nothing measured
    (40, 0, 0, "none"),  # every sequence ratio within 1% of 1
    (40, 12, 0, "seq_tis"),  # all within [floor, cap]: unbiased, nothing truncated
    (40, 12, 4, "seq_mis"),  # a tail of 10%: rejected
    (40, 30, 5, "token_tis"),  # more: the sequence ratio left its range too often
])
def test_auto_chooses_by_the_sequence_ratios_measured(sequences, beyond, outside, choice):
    assert auto_choice(sequences, beyond, outside) == choice


def _log_ratios(per_sequence: list[float], length: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer and engine log-probs whose sequences' log-ratios are `per_sequence`."""
    engine = -torch.ones(len(per_sequence), length)
    trainer = engine + torch.tensor(per_sequence)[:, None] / length
    return trainer, engine


def test_the_counts_auto_reads_are_per_sequence_and_the_same_over_packed_rows():
    ratios = [0.001, 0.2, -0.9, 1.2]  # within 1%, within [0.5, 2], below 0.5, above 2
    trainer, engine = _log_ratios(ratios)
    padded = Mismatch(cap=2.0, floor=0.5)
    padded.add(trainer, engine, torch.ones_like(trainer))
    packed = Mismatch(cap=2.0, floor=0.5)
    segments = torch.tensor([[0] * 4 + [1] * 4] * 2)
    packed.add(trainer.reshape(2, 8), engine.reshape(2, 8), torch.ones(2, 8), segments)
    assert padded.counts == packed.counts == [4, 3, 2]
    assert padded.metrics()["mismatch_sequences_outside"] == 0.5


def test_auto_starts_bounded_and_follows_each_steps_measure():
    correction = MismatchCorrection("auto")
    assert correction.mode == "token_tis"
    correction.after_step([10, 0, 0])
    assert correction.mode == "none"
    correction.after_step([0, 0, 0])  # nothing fresh measured: the last choice stays
    assert correction.mode == "none"
    fixed = MismatchCorrection("seq_mis")
    fixed.after_step([10, 0, 0])
    assert fixed.mode == "seq_mis"


def _rollouts_with_engine_noise(learner, spread: float) -> list:
    """Rollouts of the learner's weights (fresh) whose engine log-probs are moved by up to +-spread."""
    rollouts = _stale_rollouts(learner.actor, version=learner.version)
    g = torch.Generator().manual_seed(7)
    for r in rollouts:
        noise = (torch.rand(len(r.behaviour_logprobs), generator=g) - 0.5) * 2 * spread
        r.behaviour_logprobs = [x + float(n) for x, n in zip(r.behaviour_logprobs, noise)]
    return rollouts


def test_the_learner_corrects_fresh_samples_and_reports_the_weights():
    settings = _settings(mismatch="token_mis", mismatch_cap=1.5, mismatch_floor=0.8)
    learner = Learner(TinyQwen(ARCH, seed=4), None, None, settings, lambda *a: 0.0)
    learner.train(_rollouts_with_engine_noise(learner, spread=0.6))
    step = learner.optimizer_step()
    assert step["mismatch_correction"] == "token_mis"
    assert 0 < step["mismatch_weight_changed"] < 1  # some tokens masked (outside [0.8, 1.5]), not all
    assert step["mismatch_weight_max"] <= 1.5
    assert step["mismatch_tokens"] > 0


def test_auto_in_the_learner_chooses_the_next_steps_correction_from_this_steps_mismatch():
    learner = Learner(TinyQwen(ARCH, seed=4), None, None, _settings(mismatch="auto"), lambda *a: 0.0)
    learner.train(_rollouts_with_engine_noise(learner, spread=0.0))  # the engine agrees with the trainer
    first = learner.optimizer_step()
    assert first["mismatch_correction"] == FIRST_AUTO_CHOICE and first["mismatch_sequences_outside"] == 0
    assert learner.correction.mode == "none"
    learner.train(_rollouts_with_engine_noise(learner, spread=0.0))
    second = learner.optimizer_step()
    assert second["mismatch_correction"] == "none" and "mismatch_weight_mean" not in second
    learner.train(_rollouts_with_engine_noise(learner, spread=1.5))
    third = learner.optimizer_step()
    assert third["mismatch_sequences_outside"] > 0.1  # most sequence ratios outside [0.5, 2]
    assert learner.correction.mode == "token_tis"
    assert math.isfinite(third["loss"])


GRPO = ROOT / "pipelines" / "tiny_grpo.aspl"


def _with(tmp_path, options: str):
    path = tmp_path / "p.aspl"
    path.write_text(GRPO.read_text().replace("kl = 0.01, micro_tokens = 1k", f"micro_tokens = 1k, {options}"))
    return path


@pytest.mark.parametrize("options, said", [
    ("kl = 0.01, mismatch_cap = 3.0", "'mismatch_cap' has no effect with mismatch = none"),
    ("kl = 0.01, mismatch = token_tis, mismatch_floor = 0.4", "only masked IS has a floor"),
    ("kl = 0.01, dual_clip = 0.9", "it must be above 1"),
    ("kl = 0.01, ratio = sequence, dual_clip = 2", "GSPO has no dual clip"),
    ("kl = 0, kl_estimator = k2", "'kl_estimator' has no effect with kl = 0"),
    ("kl = 0.01, mismatch = sometimes", "mismatch"),
])
def test_a_loss_option_without_effect_or_out_of_range_is_refused_at_its_line(aspc, tmp_path, options, said):
    result = aspc("check", str(_with(tmp_path, options)))
    assert result.exit_code == 1, result.output
    assert "p.aspl:21:" in result.output and said in result.output, result.output


def test_the_new_loss_options_reach_the_trainers_settings(tmp_path):
    path = _with(tmp_path, "kl = 0.01, kl_estimator = k3_plus, mismatch = seq_mis, mismatch_cap = 3, "
                           "mismatch_floor = 0.25, ratio = sequence")
    settings = CpuExecutors(compile_with_passes(path).plan(), tmp_path)._settings()
    assert (settings.kl_estimator, settings.mismatch, settings.mismatch_cap, settings.mismatch_floor,
            settings.ratio, settings.dual_clip) == ("k3_plus", "seq_mis", 3.0, 0.25, "sequence", 3.0)


def test_kl_in_the_reward_without_a_reference_stage_is_refused_at_the_option(aspc, tmp_path):
    path = tmp_path / "p.aspl"
    text = (ROOT / "pipelines" / "dapo_32b.aspl").read_text()
    path.write_text(text.replace("stage update = train(actor, gen, adv) on learner {",
                                 "stage update = train(actor, gen, adv) on learner { kl_reward = 0.05,"))
    result = aspc("check", str(path))
    assert result.exit_code == 1, result.output
    assert "p.aspl:20:" in result.output and "needs input 'ref_logprobs' (kl_reward = 0.05)" in result.output
