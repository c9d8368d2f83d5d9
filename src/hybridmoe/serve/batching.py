"""Parallel slots and continuous batching (llama-server's `-np N`): the one generation thread.

Each slot has its own KV cache (and so its own prompt cache). A new request goes to the idle slot whose
cache shares the longest prefix with its prompt, when that prefix is more than `similarity` of what the slot
holds (llama-server's --slot-prompt-similarity), else to the least recently used idle slot; a request that
names its slot (`id_slot`) waits for that one. Requests that find no idle slot wait, in arrival order.

Every step takes one token from each generating sequence and, for the sequences still in their prompt,
chunks of it, at most `budget` tokens a step in all (the decode tokens first), so a long prompt is spread
over several steps instead of stalling the other streams; the step runs as one `model.forward_batch` call
(`model.forward` for a single sequence, and for each sequence alone when the batch failed, so a failure is
reported to its own request only), then each sequence samples with its own settings (jobs.Job).

Slot tasks (save, restore, erase) run on this thread between steps, once their slot is idle.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import threading
import time

import torch

log = logging.getLogger(__name__)


def _put_all(items):
    for queue, item in items:
        queue.put_nowait(item)


class Slot:
    """One sequence's place: its KV cache (made at first use), the job it runs, when it was last used."""

    def __init__(self, sid: int, n_ctx: int):
        self.id, self.n_ctx = sid, n_ctx
        self.kv = None
        self.job = None
        self.last_used = 0.0
        self.n_tasks = 0                     # slot tasks waiting for it (no job is admitted meanwhile)

    @property
    def tokens(self) -> list[int]:
        return self.kv.tokens if self.kv is not None else []

    def cache(self, model):
        if self.kv is None:
            # the model's own cache (warmed up, graphs captured) serves a slot of its size
            self.kv = model.take_cache() if self.n_ctx == model.options.ctx_size else model.new_cache(self.n_ctx)
        return self.kv


def _host_row(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Row k of a step's logits on the host (a copy where the step left them on the GPU)."""
    return logits.select(0, k).cpu()


def _settled(finish):
    """finish() now; a function that returns its result (or raises its exception) later."""
    try:
        res = finish()
    except Exception as e:                           # noqa: BLE001 - raised where the result is taken

        def again():
            raise e
        return again
    return lambda: res


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Batcher:
    """The slots, the jobs waiting for one, and the thread that runs the steps.

    unified: every slot may use the whole context (`--kv-unified`), and the sequences running at once keep
    within it together: a job waits while its prompt plus reply limit would take the running jobs' total over
    `n_ctx` (a job alone always fits)."""

    def __init__(self, model, n_slots: int, n_ctx: int, similarity: float = 0.5, unified: bool = False,
                 budget: int | None = None, on_finished=None):
        self.model, self.n_ctx, self.unified, self.similarity = model, n_ctx, unified, similarity
        self.slots = [Slot(i, n_ctx if unified else n_ctx // n_slots) for i in range(n_slots)]
        if self.slots[0].n_ctx != model.options.ctx_size and getattr(model, "_free_cache", None) is not None:
            model.take_cache()               # the model's own -c cache (the warm-up's) is not a slot's: let it go
        self.budget = budget or model.options.ubatch_size
        self.on_finished = on_finished or (lambda job: None)
        self.cond = threading.Condition()
        self.waiting: collections.deque = collections.deque()
        self.tasks: list = []                # (slot id, fn, future)
        self.closed = False
        self.thread: threading.Thread | None = None
        self.order: list = []                # running jobs in admission order
        # llama-server's per-decode counters and ours: steps, busy slots, batch sizes, distinct experts
        self.counts = dict(decodes=0, busy_slots=0, batch_sequences=0, batch_tokens=0, expert_steps=0,
                           distinct_experts=0)
        self.last_batch: dict = {}
        self.ahead = None                    # (items, finish) of a decode step queued before the last one's advance
        self.outbox: list = []               # (job, item) written this step, delivered in one event loop call

    @property
    def n_ctx_slot(self) -> int:
        return self.slots[0].n_ctx

    def warm_slots(self) -> float:
        """The slots' part of a server's warm-up (before it serves; llama-server's slots are ready at its start):
        each slot's cache made and its decode step built (one token at position 0, then forgotten), and the
        batched decode step run at each batch size up to the slots' count (and, where the GPU batch step takes
        prompt chunks as rows, a chunk of each larger bucket's size), so no request pays a slot's or a batch
        size's first use (a static step's graphs captured: ~1.4 s a slot with experts in RAM). Seconds it took."""
        from ..runtime.steps.gpu_batch import BUCKETS, bucket
        t0 = time.perf_counter()
        m = self.model
        tok = m.tokenizer.bos_id if m.tokenizer.bos_id is not None else 0
        kvs = [s.cache(m) for s in self.slots]
        try:
            for kv in kvs:
                m.forward(torch.tensor([tok]), 0, kv, all_logits=False)
                kv.tokens.clear()
            n = len(kvs)
            for B in sorted({min(b, n) for b in BUCKETS[1:] if b // 2 < n}):
                m.decode_batch([tok] * B, [0] * B, kvs[:B])
                for kv in kvs[:B]:
                    kv.tokens.clear()
            chunk, buckets = m.batch_rows(kvs[0]) if hasattr(m, "batch_rows") else (0, ())
            chunk = min(chunk, kvs[0].n_ctx)
            most = min(n * chunk, self.budget)           # the most rows a step can have
            for B in (b for b in buckets if b > bucket(min(n, BUCKETS[-1])) and b // 2 < most):
                rows = min(B, most)
                sizes = [min(chunk, rows - a) for a in range(0, rows, chunk)]
                m.forward_batch([(torch.full((c,), tok), 0, kv) for c, kv in zip(sizes, kvs)])
                for kv in kvs[:len(sizes)]:
                    kv.tokens.clear()
            m.sync()
        finally:
            for kv in kvs:
                kv.tokens.clear()
            m.stats.reset()
        return time.perf_counter() - t0

    # ---------------------------------------------------------------- from the event loop
    def _start(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="hybridmoe-gen", daemon=True)
            self.thread.start()

    def submit(self, job):
        with self.cond:
            if self.closed:                          # shutting down: it ends at once, cancelled (a 503)
                job.cancel.set()
                job.finish()
                job.done.set()
                return
            self._start()
            self.waiting.append(job)
            self.cond.notify()

    def call(self, sid: int, fn, *args) -> concurrent.futures.Future:
        """fn(model, slot, *args) on the generation thread, once slot `sid` is idle; its future."""
        fut = concurrent.futures.Future()
        with self.cond:
            self._start()
            self.slots[sid].n_tasks += 1
            self.tasks.append((sid, lambda: fn(self.model, self.slots[sid], *args), fut))
            self.cond.notify()
        return fut

    def busy(self) -> tuple[int, int]:
        """(slots generating, requests waiting for one)."""
        with self.cond:
            return sum(s.job is not None for s in self.slots), len(self.waiting)

    def close(self):
        with self.cond:
            self.closed = True
            for job in [*self.waiting, *(s.job for s in self.slots if s.job is not None)]:
                job.cancel.set()
            self.cond.notify()

    # ---------------------------------------------------------------- on the generation thread
    def _loop(self):
        while True:
            with self.cond:
                while not (self.closed or self.waiting or self.tasks or self.order):
                    self.cond.wait()
                if self.closed:
                    break
                tasks = [t for t in self.tasks if self.slots[t[0]].job is None]
                for t in tasks:
                    self.tasks.remove(t)
                self._admit()
            if tasks:                                 # a queued step is done before a slot task touches the model
                self._settle_ahead()
            for sid, fn, fut in tasks:
                try:
                    fut.set_result(fn())
                except BaseException as e:           # noqa: BLE001 - the caller gets it
                    fut.set_exception(e)
                finally:
                    with self.cond:
                        self.slots[sid].n_tasks -= 1
            if self.order:
                try:
                    self._step()
                except Exception as e:               # noqa: BLE001 - a bug: the running requests get it, not a hang
                    log.error("a batched step failed", exc_info=e)
                    for job in list(self.order):
                        job.fail(e)
                        self._end(job, failed=True)
            self._deliver()
        # shutting down: every job ends (cancelled), queued tasks fail
        for job in list(self.order):
            self._end(job)
        with self.cond:
            waiting, self.waiting = list(self.waiting), collections.deque()
            tasks, self.tasks = self.tasks, []
        for job in waiting:
            self._end(job)
        for _, _, fut in tasks:
            fut.cancel()
        self._deliver()

    def _deliver(self):
        """What the jobs wrote since the last call, to their queues on their event loops: one wake-up of each
        loop a step, not one a token."""
        if not self.outbox:
            return
        out = list(self.outbox)
        self.outbox.clear()                           # the jobs hold this list
        by_loop: dict = {}
        for job, item in out:
            by_loop.setdefault(job.loop, []).append((job.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:                      # the event loop is gone (server shut down)
                for job, _ in out:
                    if job.loop is loop:
                        job.cancel.set()

    def _pick(self, job):
        """The idle slot for this job, or None (call with the lock held)."""
        idle = [s for s in self.slots if s.job is None and not s.n_tasks]
        if job.id_slot >= 0:
            return self.slots[job.id_slot] if self.slots[job.id_slot] in idle else None
        if not idle:
            return None
        if self.similarity > 0:
            best, n_best = None, 0
            for s in idle:
                held = s.tokens
                n = common_prefix(held, job.ids)
                if held and n > n_best and n / len(held) > self.similarity:
                    best, n_best = s, n
            if best is not None:
                return best
        return min(idle, key=lambda s: s.last_used)

    def _admit(self):
        """Waiting jobs into idle slots, in arrival order (a job that names a busy slot lets others pass)."""
        used = sum(j.reserved for j in self.order) if self.unified else 0
        for job in [j for j in self.waiting if j.cancel.is_set()]:     # their clients left while they waited
            self.waiting.remove(job)
            self._end(job)
        for job in list(self.waiting):
            if self.unified and self.order and used + job.reserved > self.n_ctx:
                break                                 # the shared context is taken: wait for a job to end
            slot = self._pick(job)
            if slot is None:
                if job.id_slot >= 0:
                    continue
                break
            self.waiting.remove(job)
            slot.job, job.slot, job.outbox = job, slot, self.outbox
            slot.last_used = time.monotonic()
            used += job.reserved
            try:
                job.begin(self.model, slot.cache(self.model))
            except Exception as e:                   # noqa: BLE001 - reported to its request
                job.fail(e)
                self._end(job, failed=True)
                continue
            self.order.append(job)

    def _end(self, job, failed: bool = False):
        """The job leaves its slot (before its end item, so the client that reads it can send again)."""
        with self.cond:
            if job.slot is not None and job.slot.job is job:
                job.slot.job = None
                job.slot.last_used = time.monotonic()
            if job in self.order:
                self.order.remove(job)
        try:
            if not failed:
                job.finish()
        except Exception as e:                        # noqa: BLE001
            job.fail(e)
        finally:
            self.on_finished(job)
            job.done.set()

    def _step(self):
        for job in [j for j in self.order if j.cancel.is_set()]:
            self._end(job)
        if self.ahead is not None:                    # the step queued while the last one's jobs advanced
            items, finish = self.ahead
            self.ahead = None
            try:
                outs, top = finish()
                self._note_batch()
            except Exception as e:                   # noqa: BLE001 - nothing of it recorded: its jobs run again
                log.debug("queued step failed (%s); running it again", e)
                items = [(j, t) for j, t in items if j in self.order]
                if not items:
                    return
                outs, top = self._forward(items)
        else:
            decoding = [j for j in self.order if not j.in_prompt]
            budget = self.budget - len(decoding)
            items = [(j, j.next_tokens(1)) for j in decoding]
            for j in self.order:
                if j.in_prompt and budget > 0:
                    chunk = j.next_tokens(budget)
                    budget -= len(chunk)
                    items.append((j, chunk))
            if not items:
                return
            outs, top = self._forward(items)
        self.counts["decodes"] += 1
        self.counts["busy_slots"] += len(self.order)
        self.counts["batch_sequences"] += len(items)
        self.counts["batch_tokens"] += sum(len(t) for _, t in items)
        if top is None:
            # the greedy samplers' tokens: the argmax of their rows in one op, not one op a sequence
            greedy = [k for k, ((job, toks), out) in enumerate(zip(items, outs))
                      if not isinstance(out, BaseException) and job.greedy_after(len(toks))]
            if len(greedy) > 1:
                top = [None] * len(items)
                for k, t in zip(greedy, torch.stack([outs[k] for k in greedy]).argmax(-1).tolist()):
                    top[k] = t
        rows = isinstance(outs, torch.Tensor)
        self.ahead = self._queue_next(items, top) if rows and top is not None else None
        running = set(self.order)
        for k, (job, toks) in enumerate(items):
            if job not in running:                   # ended (cancelled) after its row was queued
                continue
            # the logits: a row of the batch's (on the host; the batch's may still be on the GPU), taken only if the
            # job's sampling reads them; else this item's, or the exception its forward raised
            out = functools.partial(_host_row, outs, k) if rows else outs[k]
            if isinstance(out, BaseException):
                job.fail(out)
                self._end(job, failed=True)
                continue
            try:
                over = job.advance(len(toks), out, top[k] if top is not None else None)
            except Exception as e:                   # noqa: BLE001 - a sampler or constraint failure
                job.fail(e)
                self._end(job, failed=True)
                continue
            if over:
                self._end(job)
        if self.ahead is not None and any(j not in self.order for j, _ in self.ahead[0]):
            # a job of the queued step ended (a stop string, a failure): its slot may take a new job or a slot task
            # before the next step, so the step's writes and records of that cache end now (its row is unused)
            self._settle_ahead()

    def _settle_ahead(self):
        """The queued step (if any) waited for now; its result (or failure) kept for the next step."""
        if self.ahead is not None:
            self.ahead = (self.ahead[0], _settled(self.ahead[1]))

    def _queue_next(self, items, top):
        """The next decode step queued on the GPU now, before this step's jobs advance (their text, stop strings,
        clients: the host's part of a step, then done while the GPU runs the next one), where it is certain: every
        running job decodes greedily from the logits as they are (its next token is this step's argmax), reads no
        logits (logprobs), has tokens and context left, and no job waits for a slot (its prompt would join the next
        step). (the next items, their result's function), or None. A job that ends anyway (a stop string) leaves its
        row unused: its cache holds one more valid key than its reply."""
        m = self.model
        if len(items) < 2 or len(items) != len(self.order) or not getattr(m, "queues_decode", False):
            return None
        with self.cond:
            if self.tasks or (self.waiting and any(s.job is None and not s.n_tasks for s in self.slots)):
                return None
        nxt = []
        for (job, toks), t in zip(items, top):
            if t is None or len(toks) != 1 or not job.greedy_after(1) or job.params.logprobs is not None or \
                    job.cancel.is_set() or job.left <= 1 or job.pos + 1 >= job.kv.n_ctx or \
                    not job.sampler.takes(t) or (t in job.eos and not job.params.ignore_eos):
                return None
            nxt.append((job, [t]))
        finish = m.decode_batch_async([t for _, (t,) in nxt], [j.pos + 1 for j, _ in nxt], [j.kv for j, _ in nxt])
        return None if finish is None else (nxt, finish)

    def _note_batch(self):
        """The batched step's sequences, tokens and distinct experts (model.stats.last_batch), for /metrics."""
        last = getattr(self.model.stats, "last_batch", None) or {}
        self.last_batch = dict(last)
        if last.get("distinct_experts") is not None:        # None: a model without experts
            self.counts["expert_steps"] += 1
            self.counts["distinct_experts"] += last["distinct_experts"]

    def _forward(self, items):
        """(the last logits [n_vocab] of each item (job, tokens), or the exception its forward raised: a list, or for
        a step of decode tokens that ran batched the [B, n_vocab] tensor of them; each row's argmax where the batched
        step gave them, else None)."""
        model = self.model
        batched = getattr(model, "forward_batch", None)
        n_tok = sum(len(t) for _, t in items)
        if len(items) > 1 and n_tok == len(items) and getattr(model, "decode_batch", None) is not None:
            try:                                     # decode tokens only: the lists' path, logits [B, n_vocab]
                out = model.decode_batch([t[0] for _, t in items], [j.pos for j, _ in items], [j.kv for j, _ in items],
                                         argmax=True, host_logits=False)
                self._note_batch()
                return out
            except Exception as e:                   # noqa: BLE001 - each alone, to find whose it is
                log.debug("batched step failed (%s); running its sequences one by one", e)
        elif (len(items) > 1 or n_tok > 1) and batched is not None:
            try:
                # the step's tokens in one tensor, cut into the items' views
                ids = torch.tensor([x for _, t in items for x in t], dtype=torch.long).split([len(t) for _, t in items])
                outs = batched([(t, j.pos, j.kv) for t, (j, _) in zip(ids, items)], all_logits=False)
                self._note_batch()
                return [o[-1] for o in outs], None
            except Exception as e:                   # noqa: BLE001 - each alone, to find whose it is
                log.debug("batched step failed (%s); running its sequences one by one", e)
        self.last_batch = {"sequences": len(items), "tokens": n_tok}
        outs = []
        for job, toks in items:
            try:
                outs.append(model.forward(torch.tensor(toks, dtype=torch.long), job.pos, job.kv,
                                          all_logits=False)[-1])
            except Exception as e:                   # noqa: BLE001 - reported to its request
                outs.append(e)
        return outs, None
