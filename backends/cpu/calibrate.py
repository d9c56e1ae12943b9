"""A micro-benchmark of a tiny model on this CPU, giving the simulator measured costs instead of
the roofline's datasheet numbers: decode step time by batch size, prefill per request and token,
the learner's passes per unit (reference and train, as the learner process runs them: its Python
work and the unit's rollouts pickled through a pipe and back included), the optimizer step,
publishing and loading a version through a pipe, a process worker's pipe round trip per decode
step, a reward model's unit, a judge's calls (one per sample, on threads) and a time-shared pool's
hand-over; the cores this process may run on and the share other processes took meanwhile; and,
for the workload, the lengths a policy writes (docs/simulator.md, "CPU calibration and cores").

Everything is timed on one torch thread, what each worker of the local runtime gets when the
workers outnumber the cores (aspc/drivers/local/threads.py): the costs are seconds of one core,
and the simulator shares the cores among the workers busy at once (aspc/costmodel/cores.py).
Every figure comes from timing one piece of work alone, never from an end-to-end run."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import multiprocessing
import os
import pickle
import queue
import statistics
import threading
import time
from pathlib import Path

import torch

from aspc.backends.cpu.batching import make_batch
from aspc.rl.call_batching import BatchedCalls
from aspc.backends.cpu.generator import BatchGenerator
from aspc.backends.cpu.judge import CpuJudge
from aspc.backends.cpu.learner import Learner
from aspc.rl.rollout import Rollout, TrainSettings
from aspc.backends.cpu.model import TinyQwen
from aspc.costmodel.calibrated import Calibration

SLOTS = 32  # KV slots of a generation instance: a step's 64 samples over 2 instances
UNIT_SAMPLES = (2, 8, 32)  # unit sizes of the learner's passes (stream = 8 in the tiny pipelines)
LENGTHS = (10, 24)  # sequence lengths (prompt and response): the tiny tasks' answers are short


EVICT_BYTES = 32 << 20  # what other processes touch between two pieces of one worker's work


@functools.cache
def _eviction_buffer() -> torch.Tensor:
    return torch.zeros(EVICT_BYTES // 4)


def _evict() -> None:
    """Write a buffer larger than the caches: as after other workers ran on the cores."""
    _eviction_buffer().add_(1.0)


def _timed(fn, repeat: int = 5, cold: bool = False) -> float:
    """The median of `repeat` calls after a warm-up call: a share of the cores that other
    processes take in bursts shows in the mean, less in the median. `cold`: the caches are
    evicted before each call, as for a worker whose piece of work follows other workers' (a
    learner pass after the generation phase, a weight load after training): measured cold, a
    reference pass of 32 samples takes 1.5x its time hot."""
    fn()
    times = []
    for _ in range(repeat):
        if cold:
            _evict()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _plane(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least-squares (fixed, per sample, per token) of times measured at (samples, tokens); a
    coefficient that comes out negative is dropped (zero) and the others fitted again."""
    keep = [0, 1, 2]
    while True:
        a = torch.tensor([[(1.0, s, t)[k] for k in keep] for s, t, _ in points], dtype=torch.float64)
        y = torch.tensor([[y] for _, _, y in points], dtype=torch.float64)
        solved = torch.linalg.lstsq(a, y).solution.flatten().tolist()
        if min(solved) >= 0 or len(keep) == 1:
            out = [0.0, 0.0, 0.0]
            for k, value in zip(keep, solved):
                out[k] = max(value, 0.0)
            return out[0], out[1], out[2]
        keep = [k for k, value in zip(keep, solved) if value >= 0] or [0]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope, both kept non-negative."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-12)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


# ---- generation ----
def _generator(model, batch: int, prompt: int) -> BatchGenerator:
    """The real generator (sampling included), its sequences never ending within the benchmark."""
    generator = BatchGenerator(model, batch, max_tokens=model.arch.max_seq, temperature=1.0)
    for i in range(batch):
        generator.add(i, [1] + [5] * (prompt - 1), seed=i)
    return generator


def _decode(model, batch: int) -> float:
    generator = _generator(model, batch, 8)
    generator.step()  # admit and prefill
    return _timed(generator.step, repeat=8)


def _prefill(model, requests: int, length: int, repeat: int = 5) -> float:
    """Admitting `requests` requests into a generator of SLOTS slots (the runtime's size at these
    steps): their prefills and first sampled tokens, beyond a decode step."""
    times = []
    for _ in range(repeat + 1):
        generator = BatchGenerator(model, SLOTS, max_tokens=model.arch.max_seq, temperature=1.0)
        for i in range(requests):
            generator.add(i, [1] + [5] * (length - 1), seed=i)
        start = time.perf_counter()
        generator._admit()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


# ---- process workers' pipes ----
STEP_CPU = 1e-3  # the CPU time a stand-in worker spends per request: about a decode step of the tiny model


def _spin(seconds: float) -> None:
    """Compute for `seconds` of this thread's CPU time (longer on the wall clock if it is preempted)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _echo(conn, reply: bytes) -> None:
    """A stand-in generation process: reads a request, unpickles it, computes a step, answers `reply`."""
    while True:
        try:
            pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        _spin(STEP_CPU)
        conn.send_bytes(reply)


def _drive(conn, calls: int, out: list) -> None:
    """A proxy thread of the controller's process: request, wait, read the reply, `calls` times."""
    request = pickle.dumps(("call", ([], "step", ())), protocol=pickle.HIGHEST_PROTOCOL)
    start = time.perf_counter()
    for _ in range(calls):
        conn.send_bytes(request)
        pickle.loads(conn.recv_bytes())
    out.append((time.perf_counter() - start) / calls)


def _round_trip(workers: int, calls: int = 200) -> float:
    """What a process worker's decode step costs beyond the step itself, with `workers` of them
    stepping at once, each driven by its own thread of one controller process (as
    aspc/drivers/local/processes.py does): the pipe, the pickles, and the controller's process
    winning a core from the busy workers and its threads the interpreter's lock. The stand-in
    processes are forked: they run no torch, so torch's thread pools cannot hang them."""
    context = multiprocessing.get_context("fork")
    reply = pickle.dumps(("ok", ([], [], True, 0)), protocol=pickle.HIGHEST_PROTOCOL)
    pipes, processes = [], []
    for _ in range(workers):
        mine, theirs = context.Pipe()
        process = context.Process(target=_echo, args=(theirs, reply), daemon=True)
        process.start()
        theirs.close()
        pipes.append(mine)
        processes.append(process)
    out: list = []
    threads = [threading.Thread(target=_drive, args=(conn, calls, out)) for conn in pipes]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for conn, process in zip(pipes, processes):
            conn.close()
            process.join(timeout=5)
    return max(0.0, sum(out) / len(out) - STEP_CPU)


def _hand_over(repeat: int = 300) -> float:
    """A time-shared pool changes hands on the CPU: nothing moves, but the controller's thread
    asks the learner's worker thread and waits for its answer (two queue hand-offs)."""
    inbox, outbox = queue.Queue(), queue.Queue()

    def worker():
        while (item := inbox.get()) is not None:
            outbox.put(item)
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    def once():
        inbox.put("switch")
        outbox.get()
    try:
        return _timed(once, repeat)
    finally:
        inbox.put(None)
        thread.join(timeout=5)


# ---- the learner ----
def _settings(critic: bool) -> TrainSettings:
    return TrainSettings(loss="ppo" if critic else "grpo", lr=3e-4, kl=0.01, clip=0.2, clip_high=0.2,
                         value_coef=0.5, entropy_coef=0.0, micro_tokens=1024, weight_decay=0.0, grad_clip=1.0,
                         overlong=0, max_tokens=24, estimator="gae" if critic else "grpo", gamma=1.0, lam=0.95,
                         normalize=True, group=4, critic_lr=1e-3)


def _rollouts(samples: int, length: int) -> list[Rollout]:
    """A unit of `samples` finished samples, every field the learner's passes read already set."""
    prompt, response = length // 2, length - length // 2
    return [Rollout([1] + [5] * (prompt - 1), [6] * response, [-1.0] * response, "417*63=", "26271",
                    {"task": "mul", "index": i}, reward=float(i % 2), ref_logprobs=[-1.0] * response,
                    values=[0.0] * response, key=(0, i // 4, i % 4), loss_mask=[1] * response)
            for i in range(samples)]


def _learner(arch, critic: bool) -> Learner:
    actor, ref = TinyQwen(arch, seed=0), TinyQwen(arch, seed=0).eval()
    value = TinyQwen(arch, seed=1, value_head=True) if critic else None
    return Learner(actor, ref, value, _settings(critic), lambda *args: 0.0)


def _learner_pass(learner: Learner, method: str, samples: int, length: int, pipe) -> float:
    """One pass over a unit as the learner process runs it (aspc/drivers/local/processes.py): the
    unit's rollouts built (for its first pass, the reference), pickled and sent through `pipe`, a
    snapshot of their fields, the pass, the fields it set sent back and copied into the
    controller's rollouts."""
    mine = _rollouts(samples, length)

    def run():
        unit = _rollouts(samples, length) if method == "reference" else mine
        rollouts = pickle.loads(_through(pipe, pickle.dumps(unit, protocol=pickle.HIGHEST_PROTOCOL)))
        before = [dict(r.__dict__) for r in rollouts]
        getattr(learner, method)(rollouts)
        changed = [{k: v for k, v in r.__dict__.items() if k not in old or v is not old[k]}
                   for r, old in zip(rollouts, before)]
        for rollout, fields in zip(unit, pickle.loads(_through(pipe, pickle.dumps(changed)))):
            rollout.__dict__.update(fields)
    seconds = _timed(run, repeat=3, cold=True)
    learner.actor.zero_grad(set_to_none=False)
    return seconds


def _through(pipe, data: bytes) -> bytes:
    """`data` sent through a pipe to another process, which acknowledges it."""
    pipe.send_bytes(data)
    pipe.recv_bytes()
    return data


def _pass_plane(learner: Learner, method: str, pipe) -> tuple[float, float, float]:
    return _plane([(s, s * n, _learner_pass(learner, method, s, n, pipe)) for s in UNIT_SAMPLES for n in LENGTHS])


def _optimizer(learner: Learner) -> float:
    def step():
        for module in filter(None, (learner.actor, learner.critic)):
            for p in module.parameters():
                p.grad = torch.zeros_like(p)
        learner.step_stats.sequences = learner.step_stats.tokens = 8
        learner.optimizer_step()
    return _timed(step)


# ---- weights and scorers ----
def _receive(conn) -> None:
    """A stand-in process at the other end of a pipe: reads what comes and acknowledges it."""
    while True:
        try:
            conn.recv_bytes()
        except EOFError:
            return
        conn.send_bytes(b"ok")


@contextlib.contextmanager
def _pipe():
    """A pipe to a forked stand-in process (it runs no torch, so torch's thread pools cannot hang it)."""
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    process = context.Process(target=_receive, args=(theirs,), daemon=True)
    process.start()
    theirs.close()
    try:
        yield mine
    finally:
        mine.close()
        process.join(timeout=5)


def _transfer(state: dict, pipe) -> float:
    """Weights pickled, sent through a pipe to another process and unpickled (a version's way
    from the learner process to the controller's, and from there to a generation process)."""
    return _timed(lambda: pickle.loads(_through(pipe, pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))))


def _publish(model, transfer: float) -> float:
    """The learner snapshots its weights and sends them to the controller's process."""
    return _timed(lambda: copy.deepcopy(model.state_dict())) + transfer


def _weight_load(model, pipe) -> float:
    """A generation process receives a version through its pipe and loads it, its caches cold
    (the learner ran meanwhile)."""
    state = copy.deepcopy(model.state_dict())

    def load():
        model.load_state_dict(pickle.loads(_through(pipe, pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))))
    return _timed(load, cold=True)


def _score(model, samples: int, length: int) -> float:
    """A scorer (reward model, judge) in the controller's process: one forward pass over a unit."""
    sequences = [([1] * (length // 2), [5] * (length - length // 2))] * samples

    @torch.no_grad()
    def run():
        batch = make_batch(sequences)
        model(batch.tokens, batch.positions, batch.mask)
    return _timed(run, repeat=3)


def _judge_unit(judge: CpuJudge, samples: int, length: int) -> float:
    """A judge scoring a unit as the local runtime does (aspc/drivers/local/scoring.py): one call
    per sample, each on a thread of its own in the controller's process, on a copy of the sample;
    calls that arrive while a pass is in flight share the next (call_batching.py)."""
    rollouts = _rollouts(samples, length)
    batched = BatchedCalls(judge.scores)

    def call(rollout):
        batched([copy.copy(rollout)])

    def run():
        threads = [threading.Thread(target=call, args=(r,), daemon=True) for r in rollouts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return _timed(run, repeat=5)


# ---- the workload ----
def policy_lengths(engine, prompts: list[tuple[list[int], int]], tools=None) -> list[int]:
    """The response lengths (model tokens, tool results not counted) the policy in `engine` writes
    for `prompts` ((ids, seed) each), sampled as the run samples; an episode engine's tool calls
    run on `tools`. What the simulation's workload should draw from when it predicts a CPU run: a
    pipeline's declared `response_lengths` describe the model it was written for."""
    for i, (ids, seed) in enumerate(prompts):
        engine.add((0, i, 0), ids, seed)
    finished = []
    while engine.busy or getattr(engine, "held", None):
        finished += engine.step()
        for pending in engine.pop_calls() if tools is not None else ():
            finished += engine.resume(pending.key, tools.run(pending.call))
    return [sum(f.mask) if f.mask is not None else len(f.response) for f in finished]


# ---- the machine ----
def _busy_seconds() -> float | None:
    """Seconds all cores of the machine have been busy since boot (/proc/stat), or None without /proc."""
    try:
        values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _own_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def calibrate(arch, length: int = 12, threads: int = 1) -> Calibration:
    """Costs of `arch` on this machine, timed on `threads` torch threads (restored afterwards), and
    the cores other processes kept busy meanwhile (`background`: the machine's busy time in
    /proc/stat beyond this process's own)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    start, busy, own = time.perf_counter(), _busy_seconds(), _own_seconds()
    try:
        calibration = _measure(arch, length)
    finally:
        torch.set_num_threads(before)
    if busy is None:
        return calibration
    others = (_busy_seconds() - busy) - (_own_seconds() - own)
    return dataclasses.replace(calibration, background=max(0.0, others / (time.perf_counter() - start)))


def _measure(arch, length: int) -> Calibration:
    model = TinyQwen(arch, seed=0)
    decode = _line([(b, _decode(model.eval(), b)) for b in (1, 4, 16, 32)])
    prefill = _plane([(r, r * n, _prefill(model, r, n)) for r in (1, 8, 32) for n in (6, 16)])[1:]
    score = _plane([(s, s * n, _score(model, s, n)) for s in UNIT_SAMPLES for n in LENGTHS])
    judge = _line([(s, _judge_unit(CpuJudge(model), s, length)) for s in (1, 4, 16)])
    plain, critic = _learner(arch, False), _learner(arch, True)
    with _pipe() as pipe:
        forward, train = _pass_plane(plain, "reference", pipe), _pass_plane(plain, "train", pipe)
        critic_train = _pass_plane(critic, "train", pipe)
        transfer, load = _transfer(copy.deepcopy(model.state_dict()), pipe), _weight_load(model, pipe)
    return Calibration(
        decode_fixed=decode[0], decode_per_seq=decode[1], prefill_fixed=prefill[0], prefill_per_token=prefill[1],
        forward_fixed=forward[0], forward_per_sample=forward[1], forward_per_token=forward[2],
        train_fixed=train[0], train_per_sample=train[1], train_per_token=train[2],
        optimizer=_optimizer(plain), weight_load=load, cores=available_cores(),
        step_round_trip=_round_trip(available_cores()), publish=_publish(model, transfer), switch=_hand_over(),
        score_fixed=score[0], score_per_sample=score[1], score_per_token=score[2],
        judge_fixed=judge[0], judge_per_sample=judge[1],
        critic_train_fixed=critic_train[0], critic_train_per_sample=critic_train[1],
        critic_train_per_token=critic_train[2], critic_optimizer=_optimizer(critic))
