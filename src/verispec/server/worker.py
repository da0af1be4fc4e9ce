"""The engine thread: owns the Engine, steps it while there is work, and hands each request's
tokens to the asyncio side. The HTTP handlers never touch the engine directly; they submit and
abort through a thread-safe inbox, so all engine state is single-threaded."""

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
    """One submitted sequence, as the HTTP side sees it."""

    prompt_ids: list[int]
    params: SamplingParams
    num_draft_tokens: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (new_tokens, finish_reason | None)
    seq: Sequence | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    done: bool = False


class EngineWorker:
    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[int, Handle] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End every running stream (finish_reason "abort") and stop the thread."""
        self._stop.set()
        self.inbox.put(("wake", None, None))
        self.thread.join(timeout=30)

    def submit(self, handle: Handle) -> None:
        self.inbox.put(("add", handle, None))

    def abort(self, handle: Handle, reason: str = "abort") -> None:
        """End a request early: "abort" (client gone) or "stop" (a stop string was found)."""
        if not handle.done:
            self.inbox.put(("abort", handle, reason))

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._drain(block=not eng.has_work)
            if self._stop.is_set():
                break
            if not eng.has_work:
                self.metrics.observe_engine(eng)  # aborts free slots without a step
                continue
            try:
                events = eng.step()
            except Exception:  # a bug in the step must not take the server down silently
                log.exception("engine step failed; ending the running requests")
                for h in list(self.handles.values()):
                    eng.abort(h.seq)
                    self._finish(h, "error")
                continue
            now = time.perf_counter()
            for ev in events:
                h = self.handles.get(ev.seq.id)
                if h is None:
                    continue
                if h.first_token_at is None and ev.new_tokens:
                    h.first_token_at = now
                    self.metrics.ttft.observe(now - h.arrived)
                self._send(h, ev.new_tokens, ev.seq.finish_reason if ev.finished else None)
                if ev.finished:
                    self._finish(h, ev.seq.finish_reason)
            self.metrics.observe_engine(eng)
        for h in list(self.handles.values()):  # shutdown: close the streams cleanly
            eng.abort(h.seq)
            self._send(h, [], "abort")
            self._finish(h, "abort")

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, h, reason = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                try:
                    h.seq = self.engine.add_request(h.prompt_ids, h.params, h.num_draft_tokens)
                    self.handles[h.seq.id] = h
                except Exception as e:  # validated before submission; this is a last line of defence
                    self._send(h, [], f"error: {e}")
                    h.done = True
            elif kind == "abort" and h.seq is not None and not h.done:
                self.engine.abort(h.seq)
                self._finish(h, reason)

    def _send(self, h: Handle, tokens: list[int], finish: str | None) -> None:
        h.loop.call_soon_threadsafe(h.events.put_nowait, (tokens, finish))

    def _finish(self, h: Handle, reason: str) -> None:
        if h.done:
            return
        h.done = True
        self.handles.pop(h.seq.id, None)
        self.metrics.request_finished(h, reason)
