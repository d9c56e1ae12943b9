"""One simulated generation instance: continuous or static batching on a token clock.

Every active sequence gains one token per decode step, so an instance needs an event only when a
sequence finishes or the batch changes — never one per token. With `count` decode steps done and
C the sum of active contexts, k more steps take k*beta(B) + alpha*(k*C + B*k*(k-1)/2).

Agentic episodes (docs/simulator.md, "Agentic episodes"): a sample's response is several model
turns. When a turn that is not the last ends, the sequence leaves the decoding batch but keeps its
KV slot (sticky) while its tool call runs; the driver runs the call and hands the sequence back
(`resume`): its observation is prefilled, and its next turn decodes with the batch.

KV capacity (docs/simulator.md, "KV cache and preemption"): an instance with a finite `kv_budget`
never holds more tokens of context than that. A request whose context does not fit waits inside the
engine; when the running sequences' next decode step would not fit, the sequence admitted last is
preempted (its KV dropped, its tokens kept) and waits at the front, as vLLM's scheduler does under
its default recompute preemption; re-admitted, it prefills its whole context again (booked `preempt`).
"""
from __future__ import annotations

import heapq
import math
from collections import deque

from aspc.costmodel.roofline import GenerationCost


KV_BLOCK = 16  # tokens in one of vLLM's KV cache blocks (its default block_size)


class GenInstance:
    def __init__(self, index: int, cost: GenerationCost, capacity: int, static: bool, devices: int,
                 kv_budget: float = math.inf):
        self.index, self.cost, self.capacity, self.static, self.devices = index, cost, capacity, static, devices
        self.kv_budget, self._bounded = kv_budget, math.isfinite(kv_budget)
        self.held: deque = deque()  # (sample, context, tokens of its turn to come, preempted) waiting for KV
        self._finish_at: dict[tuple, int] = {}  # running sample -> the decode count its turn ends at
        self._running: dict[tuple, None] = {}  # running samples in the order they (re)started
        self.kv_peak = 0.0  # the most KV (tokens of context) it ever held
        self.preemptions = 0
        # the active sequences by the decode count at which their turn ends: thousands share a
        # few hundred counts, so a heap of the counts is much smaller than one of the sequences
        self.active = 0
        self._ending: dict[int, list[tuple]] = {}  # finish count -> its sequences
        self._counts: list[int] = []  # heap of the keys of _ending
        self.ghosts = 0  # static batching: finished sequences still holding batch slots
        self.count = 0
        self.context = 0.0  # sum of the contexts of every sequence in the batch (ghosts too)
        self.clock = 0.0  # the time `count` refers to
        self.busy_until = 0.0  # prefill or a weight load stalls decoding until then
        self.segments: list[tuple[float, float, str]] = []  # busy time: (start, end, category)
        self.generation = 0  # bumps when the next event changes (lazy heap invalidation)
        self._lengths: dict[tuple, int] = {}  # sample -> its context when its turn ends
        self._turns: dict[tuple, deque] = {}  # sample -> model tokens of its turns still to come
        self._observations: dict[tuple, deque] = {}  # sample -> tokens of its tool results still to come
        self.waiting: dict[tuple, int] = {}  # sequences on a tool call -> their context (their KV stays)
        self.calls: list[tuple] = []  # turns ended by a tool call since the driver last looked
        self.tool_held: list[tuple[float, float]] = []  # times some sequence waited on a tool call
        self._held_since: float | None = None
        self._skips_finished = bool(getattr(cost, "skips_finished", False))
        # (when, generation, count, start) of the last next_event: advancing to that time from
        # that state reaches the next finish exactly, so the event needs no search for it
        self._planned: tuple | None = None

    @property
    def batch(self) -> int:
        return self.active + self.ghosts

    @property
    def live(self) -> bool:
        """Sequences in the batch, on a tool call or waiting for KV."""
        return bool(self.active or self.waiting or self.held)

    @property
    def suspended(self) -> bool:
        """Its pool is the learner's (carry-over, `suspend`): nothing it holds decodes."""
        return self.busy_until == math.inf

    def kv_used(self) -> float:
        """Tokens of context in the KV cache: the batch's and the sequences' on a tool call."""
        return self.context + (sum(self.waiting.values()) if self.waiting else 0)

    def _limit(self) -> int:
        """Decode steps before the next turn ends or (a finite KV budget) before the next step would
        not fit: each step adds a token to every sequence of the batch."""
        limit = self._counts[0] - self.count
        if self._bounded and self.active > 1:  # a lone sequence always runs (_make_room)
            room = int((self.kv_budget - self.kv_used()) // (self.active + self.ghosts))
            if room < limit:
                return max(room, 0)
        return limit

    def steps_time(self, k: int) -> float:
        return self._steps_time(k, self.cost.beta(self._computed()), self.batch)

    def _steps_time(self, k: int, beta: float, b: int) -> float:
        """steps_time with the step's beta and batch size read once (advance asks several times)."""
        return k * beta + self.cost.alpha * (k * self.context + b * k * (k - 1) / 2)

    def _computed(self) -> int:
        """Sequences a decode step computes: a CPU engine skips a static batch's finished members."""
        return self.active if self._skips_finished else self.batch

    def steps_within(self, dt: float) -> int:
        """Whole decode steps that fit in dt."""
        return self._steps_within(dt, self.cost.beta(self._computed()), self.batch)

    def _steps_within(self, dt: float, beta: float, b: int) -> int:
        a = self.cost.alpha
        qa, qb = a * b / 2, beta + a * self.context - a * b / 2
        if qa <= 0:
            return int(dt / qb) if qb > 0 else 0
        k = int((-qb + math.sqrt(qb * qb + 4 * qa * dt)) / (2 * qa))
        while k > 0 and self._steps_time(k, beta, b) > dt:
            k -= 1
        return k

    def advance(self, now: float) -> None:
        """Account decode progress up to `now` (never past the next finish). Called at every event
        of the instance (hundreds of thousands in a large simulation): its reads are inlined."""
        active = self.active
        if not active:
            self.clock = max(self.clock, now)
            return
        start = self.clock if self.clock >= self.busy_until else self.busy_until
        if now <= start:
            return
        limit = self._limit()
        b = active + self.ghosts  # batch
        if self._planned == (now, self.generation, self.count, start):
            k, end = limit, now  # the next finish, as next_event timed it from this very state
        else:
            beta = self.cost.beta(active if self._skips_finished else b)  # _computed
            k = min(self._steps_within(now - start, beta, b), limit)
            while k < limit and self._steps_time(k + 1, beta, b) <= (now - start) + 1e-9:  # float rounding
                k += 1
            if k <= 0:
                return
            end = start + self._steps_time(k, beta, b)
        self._decode_segment(start, end, k)
        self.count += k
        self.context += k * b
        self.clock = end
        if self._bounded:
            self.kv_peak = max(self.kv_peak, self.kv_used())

    def _decode_segment(self, start: float, end: float, k: int) -> None:
        """Book k decode steps from `start` to `end` (before the clock moves): the static batch's
        finished members are padding; of the rest, what the active sequences' tokens would cost at
        the saturated batch is useful and the remainder is tail (a batch below saturation). An engine
        that skips finished members (a calibrated CPU engine) pays no padding for them."""
        active, total, batch = self.active, end - start, self.active + self.ghosts
        padding = total * ((active if self._skips_finished else batch) - active) / batch
        useful = min(total - padding, self.roofline_seconds(k, active, self.context * active / batch))
        tail = total - padding - useful
        segments, cursor, negligible = self.segments, start, 1e-12 * max(total, 1.0)  # unrolled: at every event
        if useful > negligible:
            segments.append((cursor, cursor + useful, "useful"))
            cursor += useful
        if tail > negligible:
            segments.append((cursor, cursor + tail, "tail"))
            cursor += tail
        if padding > negligible:
            segments.append((cursor, cursor + padding, "padding"))

    def roofline_seconds(self, k: int, active: int, context: float) -> float:
        """What k decode steps of `active` sequences holding `context` tokens in all would take at
        the instance's saturated batch: their KV reads, and their share of a saturated step
        (the weight reads or compute of `capacity` sequences, divided among them)."""
        saturated = self.cost.beta(self.capacity) / self.capacity  # asked each time: a calibrated beta varies
        return k * active * saturated + self.cost.alpha * (k * context + active * k * (k - 1) / 2)

    def next_event(self) -> float | None:
        if not self.active or self.suspended:
            return None
        start = max(self.clock, self.busy_until)
        b = self.active + self.ghosts  # steps_time, inlined: asked at every event of the instance
        beta = self.cost.beta(self.active if self._skips_finished else b)
        when = start + self._steps_time(self._limit(), beta, b)
        self._planned = (when, self.generation, self.count, start)
        return when

    def pop_finished(self, now: float) -> list[tuple]:
        """Samples whose last turn ended; turns that end in a tool call go to `calls`."""
        self.advance(now)
        done = []
        finish_at, running = self._finish_at, self._running
        while self._counts and self._counts[0] <= self.count:
            ended = self._ending.pop(heapq.heappop(self._counts), None)
            if ended is None:  # every sequence that was to end there was preempted
                continue
            ended.sort()  # in sample order, as a heap pops them
            self.active -= len(ended)
            for sample in ended:
                del finish_at[sample]
                del running[sample]
            if not self._observations:  # no episode holds a tool call to come (and so no turns): all done
                done += ended
                continue
            for sample in ended:
                if self._observations.get(sample):  # a tool call follows this turn
                    self._wait(sample)
                else:
                    self._turns.pop(sample, None)
                    self._observations.pop(sample, None)
                    done.append(sample)
        if self.static:
            self.ghosts += len(done)
            self._end_static_batch()
        else:
            self.context -= sum([self._lengths.pop(s) for s in done])
        if self._bounded:
            before = self.preemptions
            self._make_room()
            if done and self.preemptions == before:  # finished sequences freed KV
                self._admit_held()
        self.generation += 1
        return done

    # -- KV capacity: preemption and re-admission (vLLM's recompute preemption) --
    def _make_room(self) -> None:
        """While the batch's next decode step does not fit, preempt the sequence that started last.
        A lone sequence always runs (the launch gives an engine at least one max_model_len of KV,
        aspc/costmodel/roofline.py `engine_share`)."""
        while self.active > 1 and self.kv_used() + self.active > self.kv_budget:
            self._preempt(next(reversed(self._running)))

    def _preempt(self, sample: tuple) -> None:
        finish = self._finish_at.pop(sample)
        del self._running[sample]
        members = self._ending[finish]
        members.remove(sample)
        if not members:
            del self._ending[finish]
            while self._counts and self._counts[0] not in self._ending:
                heapq.heappop(self._counts)
        to_come = finish - self.count
        context = self._lengths.pop(sample) - to_come
        self.context -= context
        self.active -= 1
        self.held.appendleft((sample, context, to_come, True))
        self.preemptions += 1
        self.generation += 1

    def _admit_held(self) -> None:
        """Start the waiting sequences that fit, in order (preempted ones first): one prefill stall,
        fresh prompts useful, preempted contexts computed again `preempt`. A sequence fits when its
        context and a KV block of room for each running sequence do (vLLM allocates KV in blocks of
        KV_BLOCK tokens, so a running sequence holds half a block of room on average; without that
        room a sequence re-admitted at once was preempted again at the next step, without end)."""
        if not self.held:
            return
        used, fresh, again = self.kv_used(), [], []
        while self.held:
            sample, context, turn, preempted = self.held[0]
            running = self.active + len(fresh) + len(again)
            if running and used + context + (running + 1) * KV_BLOCK > self.kv_budget:
                break
            self.held.popleft()
            used += context
            (again if preempted else fresh).append((sample, context, turn))
        if fresh or again:
            self._start(fresh, again)

    def _start(self, fresh: list, again: list) -> None:
        """(sample, context, tokens of its turn) entries join the batch after one prefill stall:
        fresh prompts are useful, the contexts of preempted sequences computed again `preempt`."""
        start = max(self.clock, self.busy_until)
        for entries, category in ((fresh, "useful"), (again, "preempt")):
            if entries:
                tokens = sum(e[1] for e in entries)
                end = start + self.cost.prefill(tokens, len(entries), sum(e[1] * e[1] for e in entries))
                self.segments.append((start, end, category))
                start = end
        self.busy_until = start
        self._push_all(fresh + again)

    def _end_static_batch(self) -> None:
        if not self.live:  # the static batch ends with its longest member
            self.ghosts, self.context = 0, 0.0

    def _wait(self, sample: tuple) -> None:
        """The turn ended with a tool call: out of the decoding batch, its KV kept."""
        context = self._lengths.pop(sample)
        self.context -= context
        self.waiting[sample] = context
        self.calls.append(sample)
        if self._held_since is None:
            self._held_since = self.clock

    def contexts(self) -> list[int]:
        """The context of every sequence whose KV the instance holds (the batch's, on a tool call)."""
        count, lengths, finish_at = self.count, self._lengths, self._finish_at
        return [lengths[s] - (finish_at[s] - count) for s in self._running] + list(self.waiting.values())

    def pop_calls(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls

    def resume(self, now: float, sample: tuple) -> None:
        """The sample's tool call returned: prefill its observation, then its next turn decodes."""
        self._catch_up(now)
        start = max(self.clock, self.busy_until)
        observation = self._observations[sample].popleft()
        before = self.waiting.pop(sample)
        context = before + observation
        self.busy_until = start + self.cost.prefill(observation, 1, context * context - before * before)
        self.segments.append((start, self.busy_until, "useful"))
        self._release_hold(now)
        self._push(sample, context, self._turns[sample].popleft())
        if self._bounded:
            self._make_room()

    def reads_inbox_at(self, now: float) -> float:
        """When an engine working at `now` next takes a message: at the end of the decode step or
        the stall (a prefill, a weight load) under way, or at once when idle."""
        self.advance(now)
        start = max(self.clock, self.busy_until)
        if self.active and now > start and self._limit() > 0:
            return start + self.steps_time(1)
        return max(now, start)

    def detach(self, now: float, sample: tuple) -> tuple[int, deque, deque]:
        """The episode moves to another instance after its tool call: its slot here is freed.
        Returns (context, turns still to come, observations still to come)."""
        self._catch_up(now)
        context = self.waiting.pop(sample)
        self._release_hold(now)
        self.generation += 1
        if self._bounded:
            self._admit_held()
        return context, self._turns.pop(sample), self._observations.pop(sample)

    def adopt(self, now: float, sample: tuple, context: int, turns: deque, observations: deque) -> None:
        """A moved episode: prefill its whole history and its tool's observation, then its next turn decodes."""
        self._catch_up(now)
        start = max(self.clock, self.busy_until)
        observation = observations.popleft()
        self.busy_until = start + self.cost.prefill(context + observation, 1, (context + observation) ** 2)
        self.segments.append((start, self.busy_until, "useful"))
        if observations:
            self._turns[sample], self._observations[sample] = turns, observations
        self._push(sample, context + observation, turns.popleft())
        if self._bounded:
            self._make_room()

    def end_on_tool(self, now: float, sample: tuple) -> None:
        """The sample's episode ended on its tool call (a timeout): its slot is free, nothing decodes."""
        self._catch_up(now)
        context = self.waiting.pop(sample)
        self._turns.pop(sample, None)
        self._observations.pop(sample, None)
        self._release_hold(now)
        if self.static:  # a finished member holds its slot until the static batch ends
            self.ghosts += 1
            self.context += context
            self._end_static_batch()
        elif self._bounded:
            self._admit_held()
        self.generation += 1

    def _release_hold(self, now: float) -> None:
        if not self.waiting and self._held_since is not None:
            self.tool_held.append((self._held_since, now))
            self._held_since = None

    def held_intervals(self, until: float) -> list[tuple[float, float]]:
        """When some sequence waited on a tool call (one still waiting counts until `until`)."""
        return self.tool_held + ([(self._held_since, until)] if self._held_since is not None else [])

    def _push(self, sample: tuple, context: int, turn: int) -> None:
        self._push_all([(sample, context, turn)])

    def _push_all(self, entries: list[tuple[tuple, int, int]]) -> None:
        """(sample, its context, the tokens of its turn) join the decoding batch (thousands at a
        batch's start: the instance's fields read once)."""
        ending, counts, lengths, count, added = self._ending, self._counts, self._lengths, self.count, 0
        finish_at, running = self._finish_at, self._running
        for sample, context, turn in entries:
            finish = count + turn
            members = ending.get(finish)
            if members is None:
                ending[finish] = [sample]
                heapq.heappush(counts, finish)
            else:
                members.append(sample)
            lengths[sample] = context + turn
            finish_at[sample] = finish
            running[sample] = None
            added += context
        self.active += len(entries)
        self.context += added  # whole token counts: the same sum in any order
        self.generation += 1
        if self._bounded:
            self.kv_peak = max(self.kv_peak, self.kv_used())

    def _finish_step_in_progress(self, now: float) -> None:
        """A decode step under way when new work arrives completes first (an engine admits new
        requests and loads weights between steps, never inside one)."""
        start = max(self.clock, self.busy_until)
        if self.active and now > start and self._limit() > 0:
            end = start + self.steps_time(1)
            self._decode_segment(start, end, 1)
            self.count += 1
            self.context += self.batch
            self.clock = end
            self.generation += 1

    def _catch_up(self, now: float) -> None:
        self.advance(now)
        self._finish_step_in_progress(now)
        self.clock = max(self.clock, now)

    def admit(self, now: float, requests: list, response_len, episode=None) -> None:
        """Start requests: prefill them (a stall), then they decode with the batch. `episode`
        (sample -> (model tokens per turn, observation tokens per tool call)): multi-turn samples;
        a tool call follows each turn that has an observation (one more call than turns: the
        episode ends on that call, `end_on_tool`)."""
        self._catch_up(now)
        if episode is None:  # one turn each
            entries = [(r.sample, r.prompt_len, response_len(r.sample)) for r in requests]
        else:
            entries = []
            for r in requests:
                turns, observations = episode(r.sample)
                if observations:
                    self._turns[r.sample] = deque(turns[1:])
                    self._observations[r.sample] = deque(observations)
                entries.append((r.sample, r.prompt_len, turns[0]))
        if self._bounded:  # they wait for KV behind the sequences already waiting
            self.held.extend((sample, context, turn, False) for sample, context, turn in entries)
            self._admit_held()
        else:
            self._start(entries, [])

    def suspend(self, now: float) -> None:
        """Its devices go to the learner (a time-shared pool): the sequences in flight stop where
        they are and their KV cache is dropped with the engine's memory; the interrupting weight
        sync after `wake` computes it again (load_weights)."""
        self.advance(now)
        self.clock = max(self.clock, now)
        self.busy_until = math.inf  # a stall without end: nothing decodes (`suspended`)
        self.generation += 1

    def wake(self, now: float) -> None:
        """The pool is back: the instance works again from `now`."""
        self.busy_until = self.clock = max(self.clock, now)
        self.generation += 1

    def accepts_more(self) -> bool:
        """Static batching admits a new batch only when the previous one has ended."""
        return not self.static or not self.live

    def load_weights(self, now: float, seconds: float, interrupt: bool) -> float:
        """A weight sync: stall for `seconds`; an interrupted batch re-prefills its KV cache."""
        self.advance(now)
        self._finish_step_in_progress(now)
        start = max(now, self.busy_until, self.clock)
        end = start + seconds
        if interrupt and self.live:  # sequences on a tool call re-prefill their KV too
            contexts = self.contexts()
            end += self.cost.prefill(int(sum(contexts)), len(contexts), sum(c * c for c in contexts))
        self.busy_until = end
        self.segments.append((start, end, "sync"))
        self.generation += 1
        return end
