"""The engine thread: owns the Engine, steps it while there is work, and hands each request's
tokens to the asyncio side. The HTTP handlers never touch the engine directly; they submit and
release through a thread-safe inbox, so all engine state is single-threaded.

Every handle ends with exactly one terminal event (a finish reason, or "error" with a status and a
message), so no client ever waits for a request the engine has given up:
- an exception in `Engine.step` fails the requests that step was serving. The step does not say
  which request it came from, so every admitted request fails ("error", 500); requests still
  waiting for a KV slot stay queued, and the thread goes on serving;
- `drain(seconds)` (SIGTERM) refuses new requests (503) and ends the running ones with
  finish_reason "abort" once the drain time is over, so open streams close with [DONE].

Every handle is also released exactly once by the HTTP side (`release`), when its choice is over or
its client is gone; that frees its KV slot if the engine is still generating for it, and records
its metrics with the finish reason and the number of tokens the client actually received.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine import Engine
from ..sequence import Sequence
from ..sampling import SamplingParams
from .metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class Handle:
    """One submitted sequence (one choice of one prompt), as the HTTP side sees it."""

    prompt_ids: list[int]
    params: SamplingParams
    num_draft_tokens: int | None
    loop: asyncio.AbstractEventLoop
    choice: int = 0  # index among the n choices of its prompt (the prompt is counted once, at 0)
    draft_tree: str | None = None  # the request's draft shape (None: the server's)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (new_tokens, finish_reason | None)
    seq: Sequence | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    done: bool = False  # the engine is finished with it; its terminal event is sent
    finish_reason: str | None = None
    error: tuple[int, str, str] | None = None  # (HTTP status, code, message) of an "error" finish
    returned: int | None = None  # tokens the client received, when fewer than generated (a stop string)
    released: bool = False

    @property
    def num_returned(self) -> int:
        if self.returned is not None:
            return self.returned
        return self.seq.num_output if self.seq is not None else 0


class EngineWorker:
    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self.vocab_size = engine.model.config.vocab_size
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[int, Handle] = {}
        self._stop = threading.Event()
        self._drain_until: float | None = None  # set by drain(): time.monotonic() deadline
        self.thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End every running stream (finish_reason "abort") and stop the thread."""
        self._stop.set()
        self.inbox.put(("wake", None, None))
        self.thread.join(timeout=30)

    def drain(self, seconds: float) -> None:
        """Shutting down: refuse new requests now; end the running ones after `seconds`."""
        self.inbox.put(("drain", None, seconds))

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    def submit(self, handle: Handle) -> None:
        self.inbox.put(("add", handle, None))

    def release(self, handle: Handle, reason: str | None = None) -> None:
        """The HTTP side is done with `handle` (its choice is over, or its client is gone). Call it
        exactly once per handle; `reason` overrides the finish reason ("stop" at a stop string)."""
        if handle.released:
            return
        handle.released = True
        if handle.done:  # the engine no longer touches it: record here
            self.metrics.request_finished(handle, reason or handle.finish_reason)
        else:
            self.inbox.put(("release", handle, reason))

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._read_inbox(block=not eng.has_work)
            if self._stop.is_set():
                break
            if self._drain_until is not None and time.monotonic() >= self._drain_until and self.handles:
                self._end_all("abort")
            if not eng.has_work:
                self.metrics.observe_engine(eng)  # releases free slots without a step
                continue
            try:
                events = eng.step()
            except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving the rest
                self._step_failed(e)
                self.metrics.observe_engine(eng)
                continue
            self._hand_off(events)
            self.metrics.observe_engine(eng)
        self._end_all("abort")  # shutdown: close the streams cleanly

    def _hand_off(self, events) -> None:
        """Give a step's tokens to the HTTP side: one call into each event loop per step, however
        many requests the step served. Text, stop strings, SSE and metrics happen there, so the
        engine thread goes straight on to the next step. A request that finished is marked done
        here first (the HTTP side that sees its terminal event may release it at once)."""
        now = time.perf_counter()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for ev in events:
            h = self.handles.get(ev.seq.id)
            if h is None:
                continue
            first = h.first_token_at is None and bool(ev.new_tokens)
            if first:
                h.first_token_at = now
            reason = None
            if ev.finished:
                reason = ev.seq.finish_reason
                self._mark_done(h, reason)
            batches.setdefault(h.loop, []).append((h, ev.new_tokens, reason, first))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch) -> None:
        """On the event loop: queue each request's new tokens for its handler."""
        for h, tokens, reason, first in batch:
            if first:
                self.metrics.ttft.observe(h.first_token_at - h.arrived)
            h.events.put_nowait((tokens, reason))

    def _read_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, h, arg = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._add(h)
            elif kind == "release":
                aborted = h.seq is not None and not h.done
                if aborted:
                    self._evict(h.seq)
                    self._finish(h, arg or "abort", send=False)  # nobody listens any more
                self.metrics.request_finished(h, arg or ("abort" if aborted else h.finish_reason))
            elif kind == "drain":
                self._drain_until = time.monotonic() + arg

    def _add(self, h: Handle) -> None:
        if self._drain_until is not None:
            return self._fail(h, 503, "shutting_down", "the server is shutting down; retry on another instance")
        bad = next((t for t in h.prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:  # the API checks this first; the engine must never see such an id
            return self._fail(h, 400, "invalid_token_id", f"token id {bad} is outside the vocabulary "
                                                           f"(0..{self.vocab_size - 1})")
        try:
            h.seq = self.engine.add_request(h.prompt_ids, h.params, h.num_draft_tokens, h.draft_tree)
        except ValueError as e:  # validated before submission; a last line of defence
            return self._fail(h, 400, "invalid_request", str(e))
        except Exception as e:  # noqa: BLE001
            log.exception("add_request failed")
            return self._fail(h, 500, "engine_error", f"the engine could not take this request ({type(e).__name__}: {e})")
        self.handles[h.seq.id] = h

    def _step_failed(self, e: Exception) -> None:
        log.exception("engine step failed; failing the requests it was serving")
        eng = self.engine
        admitted = [h for h in self.handles.values() if not any(h.seq is s for s in eng.waiting)]
        msg = f"the engine failed while serving this request ({type(e).__name__}: {e}); the server goes on serving"
        for h in admitted or list(self.handles.values()):
            self._evict(h.seq)
            self._fail(h, 500, "engine_error", msg)

    def _evict(self, seq: Sequence) -> None:
        """Take seq out of the engine, freeing its KV slot, even from a state a failed step left."""
        try:
            self.engine.abort(seq)
        except Exception:  # noqa: BLE001 - the failed step left it half-moved: take it out by hand
            log.exception("abort of request %d failed; removing it by hand", seq.id)
            eng = self.engine
            for lst in (eng.waiting, eng.prefilling, eng.running):
                for s in [s for s in lst if s is seq]:
                    lst.remove(s)
            if seq.slot >= 0:
                try:
                    eng.cache.free(seq.slot)
                except Exception:  # noqa: BLE001 - already free
                    pass
            seq.finish_reason = seq.finish_reason or "abort"

    def _end_all(self, reason: str) -> None:
        for h in list(self.handles.values()):
            self._evict(h.seq)
            self._finish(h, reason)

    def _fail(self, h: Handle, status: int, code: str, message: str) -> None:
        h.error = (status, code, message)
        self._finish(h, "error")

    def _send(self, h: Handle, tokens: list[int], finish: str | None) -> None:
        h.loop.call_soon_threadsafe(h.events.put_nowait, (tokens, finish))

    def _finish(self, h: Handle, reason: str, tokens: list[int] | None = None, send: bool = True) -> None:
        """The engine is done with h: mark it, then send its terminal event (in that order: the HTTP
        side that sees the event may release h at once and must find it done)."""
        if h.done:
            return
        self._mark_done(h, reason)
        if send:
            self._send(h, tokens or [], reason)

    def _mark_done(self, h: Handle, reason: str) -> None:
        h.finish_reason, h.finished_at = reason, time.perf_counter()
        if h.seq is not None:
            self.handles.pop(h.seq.id, None)
        h.done = True
