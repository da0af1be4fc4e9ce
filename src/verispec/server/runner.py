"""Running the app under uvicorn: a log line with the address once it listens, and a drain on
SIGTERM / SIGINT so that open streams end with a finish reason and [DONE]."""

from __future__ import annotations

import sys

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server plus: one log line with the address once it listens, and on SIGTERM/SIGINT
    a drain (the engine thread refuses new requests and ends running ones after `drain_s`), so the
    open streams end with a finish reason and [DONE] before uvicorn closes the connections.
    uvicorn waits for open connections up to timeout_graceful_shutdown: keep it above drain_s."""

    def __init__(self, config: uvicorn.Config, worker, drain_s: float, model_name: str, drafter=None):
        super().__init__(config)
        self.worker, self.drain_s, self.model_name, self.drafter = worker, drain_s, model_name, drafter

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        drafter = getattr(self.drafter, "name", None) or "none"
        print(f"verispec serve: ready at http://{host}:{port}/v1 (model {self.model_name}, drafter {drafter})",
              file=sys.stderr, flush=True)

    def handle_exit(self, sig, frame) -> None:
        self.worker.drain(self.drain_s)
        super().handle_exit(sig, frame)
