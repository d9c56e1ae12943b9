"""A reward model on several NPUs (backends/ascend/reward_model.py) and the launch script's
processes (`python -m aspc.backends.ascend.executors ROLE ...`), on CPU: rank 0's calls reach the
other tensor-parallel ranks in order and stop them; the launch plan's `reward` processes find their
rank; every process of every bundled pipeline's launch plan parses."""
import json
import queue
import threading

import pytest

from aspc.backends.ascend import executors as npu_executors
from aspc.backends.ascend import reward_model
from aspc.backends.ascend.call_broadcast import follow
from aspc.backends.ascend.reward_model import NpuRewardModel, RankLeader
from npu_scorer_fakes import GptStandIn
from test_ascend_conformance import PIPELINES, launch
from test_ascend_scorers import cpu_reward_model, items

LAUNCHER = ("python", "-m", "aspc.backends.ascend.executors")


def no_npu():
    raise npu_executors.AscendUnavailable("no NPU here (a test)")


def test_every_process_of_every_launch_plan_parses(monkeypatch):
    """Each launch plan's command line (what `aspc run --dry-run` prints) is accepted by the
    executors' argument parser; the process then stops at the NPU check (exit code 1), not at
    argparse (SystemExit 2)."""
    monkeypatch.setattr(npu_executors, "require_npu", no_npu)
    commands = {process.command for name in PIPELINES for process in launch(name).processes}
    roles = set()
    for command in sorted(commands):
        assert command[:3] == LAUNCHER, command
        assert npu_executors.main(list(command[3:])) == 1, command
        roles.add(command[3])
    assert {"generate", "train", "reward"} <= roles  # the reference and the critic run in train's processes


def test_a_stage_or_rank_the_plan_does_not_have_is_a_clear_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(npu_executors, "require_npu", lambda: None)
    plan = tmp_path / "launch.json"
    plan.write_text(launch("tiny_grpo_split").to_json(), encoding="utf-8")
    for argv, what in ((["--stage", "nope", "--rank", "1"], "no stage 'nope'"),
                       (["--stage", "update", "--rank", "7"], "no process of rank 7 in stage 'update'")):
        assert npu_executors.main(["train", "--plan", str(plan)] + argv) == 2
        message = capsys.readouterr().err
        assert what in message and "--dry-run" in message


def test_a_judge_engine_line_says_where_the_judge_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(npu_executors, "require_npu", lambda: None)
    plan = tmp_path / "launch.json"
    plan.write_text(launch("tiny_rlaif").to_json(), encoding="utf-8")
    assert npu_executors.main(["generate", "--plan", str(plan), "--stage", "score"]) == 2
    assert "judge engine of stage score runs in the scorer process" in capsys.readouterr().err


class Broadcast:
    """broadcast_call between threads: rank 0 sends, each follower receives in order."""

    def __init__(self, followers: int):
        self.queues = [queue.Queue() for _ in range(followers)]

    def send(self, call):
        for q in self.queues:
            q.put(call)
        return call

    def receiver(self, rank: int):
        return lambda _: self.queues[rank - 1].get(timeout=30)


class Recording(NpuRewardModel):
    """A follower rank's model: what rank 0 asked it to score, and its values."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen, self.values = [], []

    def score_pairs(self, pairs):
        values = super().score_pairs(pairs)
        self.seen.append(pairs)
        self.values.append(values.tolist())
        return values


def test_the_other_tensor_parallel_ranks_run_rank_zeros_forwards_in_order_until_it_stops():
    """Three followers of rank 0's RankLeader (their shares of the same model here): each call's
    sequences, cut to max_seq as the CPU reward model cuts them, reach every rank before rank 0 runs
    its forward; concurrent calls go one at a time; `close` stops them with the count of calls."""
    plan, cpu = cpu_reward_model()
    max_seq = plan.model("rm").arch.max_seq
    broadcast = Broadcast(3)
    followers = [Recording(GptStandIn(cpu.decoder), max_seq) for _ in range(3)]
    counts = {}
    threads = [threading.Thread(target=lambda r=r: counts.update({r: follow(followers[r - 1], broadcast.receiver(r))}))
               for r in (1, 2, 3)]
    for t in threads:
        t.start()
    leader = RankLeader(NpuRewardModel(GptStandIn(cpu.decoder), max_seq), broadcast.send)
    answers = {}
    calls = [threading.Thread(target=lambda i=i: answers.update({i: leader.scores(items()[i:i + 2])}))
             for i in (0, 2, 4)]
    for c in calls:
        c.start()
    for c in calls:
        c.join(30)
    leader.close()
    for t in threads:
        t.join(30)
    assert counts == {1: 3, 2: 3, 3: 3}
    for follower in followers:
        assert sorted(follower.seen) == sorted(reward_model.NpuRewardModel(None, max_seq).fitted(
            [(r.prompt, r.response) for r in items()[i:i + 2]]) for i in (0, 2, 4))
        assert all(len(p) + len(r) <= max_seq for call in follower.seen for p, r in call)
    assert sorted(answers[i] for i in answers) == sorted(followers[0].values)


def test_a_sequence_padded_for_sequence_parallelism_keeps_its_last_tokens_value():
    """Padded at its end to a multiple of tp, a sequence's last real token reads the same value (causal
    attention), up to float32 rounding of the longer matrices (2e-6 on values near 9 here)."""
    plan, cpu = cpu_reward_model()
    max_seq = plan.model("rm").arch.max_seq
    plain = NpuRewardModel(GptStandIn(cpu.decoder), max_seq).scores(items())
    padded = NpuRewardModel(GptStandIn(cpu.decoder), max_seq, pad_to=4).scores(items())
    assert padded == pytest.approx(plain, abs=1e-5)


def test_a_reward_process_of_the_launch_plan_builds_its_rank_and_follows(monkeypatch, capsys):
    """rlhf_32b_rm (tp = 4, two instances): `reward --stage score --rank 3 --instance 1` builds rank 3
    of instance 1 with that process's arguments and follows rank 0; rank 0 is the scorer process."""
    built = []
    monkeypatch.setattr(reward_model, "build_rank", lambda stage, args, max_seq: built.append((stage, args)) or "m")
    plan = json.loads(launch("rlhf_32b_rm").to_json())
    assert reward_model.run_rank(plan, "score", 1, 3, follow=lambda model: 5) == 0
    [(stage, args)] = built
    process = next(p for p in plan["processes"] if p["name"] == "score.1.rank3")
    assert stage["stage"] == "score" and stage["config"]["tensor_model_parallel_size"] == 4
    assert args == process["model_args"] and "ran 5 calls" in capsys.readouterr().err
    assert reward_model.run_rank(plan, "score", 0, 0) == 2
    assert "scorer process" in capsys.readouterr().err
