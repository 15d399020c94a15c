"""The batcher: a bounded request queue feeding the sampler, one batch at a time, on one worker thread.

The rule: when the worker starts a batch, it takes the oldest waiting request and every other waiting request that
can share its decode steps, up to ``serve.max_batch``. With fewer waiting (and room in the queue), it first waits
until no request has arrived for ``serve.batch_wait_ms`` (at most ``max_batch`` such windows after it saw the
first): clients that send together share a batch even when their requests arrive a few milliseconds apart (under
load, 8 clients' requests spread over 100 ms, 3-25 ms apart). A request arriving while a batch runs waits for the
next one ("continuous-ish": rows join at batch boundaries, not at every step). Requests share a batch when they are
for the same side (``base``: the adapter disabled; ``tuned``: enabled; never mixed) and resolve to the same sampling
parameters apart from ``max_tokens`` (the batch runs to the largest; each row stops at its own through
:class:`~qwenft.generation.results.RowControl`). A sampled request with a ``seed`` runs alone, so that its seed
reproduces its answer. The queue holds at most ``serve.max_queue`` waiting requests; one more is refused
(:class:`QueueFull`, answered 429). A client that leaves cancels its job (:meth:`Scheduler.cancel`): a waiting job
leaves the queue at once (counted ``abort``), a running row ends after its next token, and a batch whose rows all
ended stops decoding.

Events go from the worker thread to the request's asyncio queue with ``call_soon_threadsafe``: :class:`Delta`
events, then one :class:`Done` or :class:`Failed`; ``tokens`` lists each :class:`Token` generated since the previous
event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from qwenft.generation.params import SamplingParams
from qwenft.generation.results import RowControl, SequenceResult

log = logging.getLogger(__name__)

_ids = itertools.count()


class Token(NamedTuple):
    """One generated token: its id, the entropy (nats) of the distribution it was drawn from, and
    ``(its logprob, [(id, logprob)] of the k most likely)`` when its request asked for logprobs (else None)."""

    id: int
    entropy: float
    logprobs: Optional[Tuple[float, Sequence[Tuple[int, float]]]]


@dataclass(frozen=True)
class Delta:
    """Text the request's answer grew by, and the tokens generated since the previous event."""

    text: str
    tokens: List[Token]


@dataclass(frozen=True)
class Done:
    """The request's finished sequence, and the tokens generated since the previous event (the last event)."""

    result: SequenceResult
    tokens: List[Token]


@dataclass(frozen=True)
class Failed:
    """The request ends without an answer: ``error`` is :class:`Stopping` or what the model raised (the last event)."""

    error: BaseException


Event = Union[Delta, Done, Failed]


class QueueFull(Exception):
    """The queue holds ``serve.max_queue`` requests already (answered 429)."""


class Stopping(Exception):
    """The server is shutting down (answered 503)."""


@dataclass
class Job:
    """One request in the batcher.

    Attributes:
        side: ``base`` or ``tuned``; model: its id in the API (metrics label).
        prompt: the prompt's token ids; overrides: its sampler settings (``GenerateConfig`` fields);
        params: those settings resolved; logprobs: -1, or alternatives per token.
        emit: called from the worker thread with each event (thread-safe: it hands the event to the request's loop).
    """

    side: str
    model: str
    prompt: List[int]
    overrides: Dict[str, Any]
    params: SamplingParams
    logprobs: int
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    number: int = field(default_factory=lambda: next(_ids))
    pending: List[Token] = field(default_factory=list)
    first_at: Optional[float] = None
    last_at: Optional[float] = None
    generated: int = 0

    def key(self) -> Tuple:
        """Requests with equal keys may share a batch (see the module's rule)."""
        alone = self.number if (self.params.seed is not None and not self.params.greedy) else None
        return self.side, dataclasses.replace(self.params, max_new_tokens=0, seed=None), alone


class _BatchControl(RowControl):
    """Per-row ``max_tokens``, cancellation and per-token bookkeeping of one batch (see :class:`RowControl`)."""

    def __init__(self, jobs: List[Job], metrics, width: int, kv_bytes_per_token: int):
        self.jobs, self.metrics, self.width, self.kv_per_token = jobs, metrics, width, kv_bytes_per_token
        self.logprobs = max(job.logprobs for job in jobs)
        self.longest = 0

    def token(self, row, token, entropy, logprobs):
        job = self.jobs[row]
        now = time.perf_counter()
        label = job.model
        if job.first_at is None:
            job.first_at = now
            self.metrics.ttft.labels(label).observe(now - job.arrived)
        else:
            self.metrics.itl.labels(label).observe(now - job.last_at)
        job.last_at = now
        self.metrics.generation_tokens.labels(label).inc()
        self.metrics.entropy.labels(label).observe(entropy)
        if logprobs is not None:
            logprobs = (logprobs[0], logprobs[1][:max(job.logprobs, 0)])
        job.pending.append(Token(token, entropy, logprobs if job.logprobs >= 0 else None))
        job.generated += 1
        if job.generated > self.longest:  # the cache grew by one position (every row holds the same length)
            self.longest = job.generated
            self.metrics.kv_usage.labels(label).set(self.kv_per_token * len(self.jobs) * (self.width + self.longest))

    def finish(self, row, generated):
        job = self.jobs[row]
        if job.cancelled.is_set():
            return "cancelled"
        return "length" if generated >= job.params.max_new_tokens else None


class Scheduler:
    """The queue and the worker thread.

    Args:
        run_batch: ``run_batch(side, prompts, overrides, on_text, control)`` runs one batch through the sampler on
            that side and returns its :class:`~qwenft.generation.results.GenerationOutput`.
        metrics: a :class:`~qwenft.serve.metrics.ServeMetrics`.
        max_batch: requests per batch at most; max_queue: waiting requests at most.
        kv_bytes_per_token: KV-cache bytes of one cached token (the planner's formula), for the usage gauge.
        peak_bytes: returns the process's peak memory (bytes), read after each batch.
        batch_wait_s: when fewer than ``max_batch`` requests wait, start once none arrived for this long (at
            most ``max_batch`` such windows after the worker saw the first).
    """

    def __init__(self, run_batch: Callable, metrics, max_batch: int, max_queue: int, kv_bytes_per_token: int,
                 peak_bytes: Callable[[], int], batch_wait_s: float = 0.0):
        self._run_batch, self.metrics, self.batch_wait_s = run_batch, metrics, batch_wait_s
        self.max_batch, self.max_queue = max_batch, max_queue
        self.kv_per_token, self._peak = kv_bytes_per_token, peak_bytes
        self._waiting: List[Job] = []
        self._running: List[Job] = []
        self._cond = threading.Condition()
        self._paused = False
        self._stopping = False
        self._arrived = 0.0  # time.monotonic() of the last submit
        self.batches: List[Tuple[str, int]] = []  # (side, rows) of every batch run, in order
        self._thread = threading.Thread(target=self._loop, name="qwenft-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            QueueFull: ``max_queue`` requests wait already. Stopping: the server is shutting down.
        """
        with self._cond:
            if self._stopping:
                raise Stopping()
            self._drop_cancelled()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull()
            self._waiting.append(job)
            self._arrived = time.monotonic()
            self._count_waiting()
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """The client of ``job`` left (or its answer is complete: then a no-op): a waiting job leaves the queue now
        (``request_success_total{finished_reason="abort"}``), a running row ends after its next token."""
        job.cancelled.set()
        with self._cond:
            self._drop_cancelled()

    def _drop_cancelled(self) -> None:
        """Remove cancelled jobs from the queue, counted as aborted (called with the lock held)."""
        gone = [j for j in self._waiting if j.cancelled.is_set()]
        if gone:
            self._waiting = [j for j in self._waiting if not j.cancelled.is_set()]
            for job in gone:
                self.metrics.request_success.labels(job.model, "abort").inc()
            self._count_waiting()

    def _count_waiting(self) -> None:
        counts: Dict[str, int] = {}
        for job in self._waiting:
            counts[job.model] = counts.get(job.model, 0) + 1
        self.metrics.set_waiting(counts)

    @contextlib.contextmanager
    def paused(self):
        """Hold new batches while the block runs (the running one finishes); requests queue up meanwhile."""
        with self._cond:
            self._paused = True
        try:
            yield self
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, fail the waiting ones (503), cancel the running batch's rows (it stops after their
        next token) and wait up to ``timeout`` seconds for the worker to end."""
        with self._cond:
            self._stopping = True
            waiting, self._waiting = self._waiting, []
            for job in self._running:
                job.cancelled.set()
            self._cond.notify_all()
        for job in waiting:
            job.emit(Failed(Stopping()))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _take(self) -> List[Job]:
        """The next batch (called with the lock held; ``_waiting`` is non-empty)."""
        self._drop_cancelled()
        if not self._waiting:
            return []
        key = self._waiting[0].key()
        batch = [j for j in self._waiting if j.key() == key][:self.max_batch]
        chosen = {j.number for j in batch}
        self._waiting = [j for j in self._waiting if j.number not in chosen]
        self._count_waiting()
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (self._paused or not self._waiting):
                    self._cond.wait()
                # A batch that could start with fewer than max_batch rows waits until batch_wait_s passed without
                # an arrival, and at most max_batch such windows (requests queued during the last batch: none).
                # A full queue starts too: no more requests can come (a max_queue below max_batch).
                last = time.monotonic() + self.batch_wait_s * self.max_batch
                while not self._stopping and len(self._waiting) < min(self.max_batch, self.max_queue):
                    now = time.monotonic()
                    deadline = min(self._arrived + self.batch_wait_s, last)
                    if now >= deadline:
                        break
                    self._cond.wait(deadline - now)
                if self._stopping:
                    return
                batch = self._take()
                self._running = batch
            if batch:
                try:
                    self._run(batch)
                finally:
                    with self._cond:
                        self._running = []

    def _run(self, jobs: List[Job]) -> None:
        side, label = jobs[0].side, jobs[0].model
        self.batches.append((side, len(jobs)))
        self.metrics.batch_rows.labels(label).observe(len(jobs))
        self.metrics.running.labels(label).set(len(jobs))
        width = max(len(j.prompt) for j in jobs)
        control = _BatchControl(jobs, self.metrics, width, self.kv_per_token)
        overrides = dict(jobs[0].overrides, max_new_tokens=max(j.params.max_new_tokens for j in jobs))

        def on_text(row: int, delta: str) -> None:
            job = jobs[row]
            job.emit(Delta(delta, job.pending))
            job.pending = []

        try:
            out = self._run_batch(side, [j.prompt for j in jobs], overrides, on_text, control)
        except Exception as exc:  # a model fault: every request of the batch is answered with it
            for job in jobs:
                job.emit(Failed(exc))
            return
        finally:
            self.metrics.running.labels(label).set(0)
            self.metrics.kv_usage.labels(label).set(0)
        now = time.perf_counter()
        for job, seq in zip(jobs, out.sequences):
            reason = {"eos": "stop", "stop_string": "stop", "cancelled": "abort"}.get(seq.stop_reason, "length")
            self.metrics.request_success.labels(label, reason).inc()
            self.metrics.prompt_tokens.labels(label).inc(seq.prompt_tokens)
            self.metrics.e2e.labels(label).observe(now - job.arrived)
            job.emit(Done(seq, job.pending))
            job.pending = []
        if out.stats.decode_tokens:
            self.metrics.decode_tps.labels(label).set(out.stats.decode_tokens_per_s)
        self.metrics.set_peak(self._peak())
