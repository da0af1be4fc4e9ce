"""A `verispec serve` subprocess on a free local port: started, waited for, stopped with SIGTERM;
or an app served in a thread of this process (ThreadServer).

Used by the HTTP load sweep of `verispec bench` and by the server's tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, threads: int | None = None, log_path: str | None = None):
        """args: `verispec serve` arguments (the port is chosen here); threads: torch threads of the process."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        # a file, never a pipe: nobody reads a pipe while the server runs, and once its buffer is
        # full the server would block on its next log line (one per request under load)
        self._log = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, text=True, env=env)

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def wait_ready(self, timeout: float = 300) -> "ServerProcess":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not become healthy within {timeout:.0f} s")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


class ThreadServer:
    """An app from `create_app`, served by uvicorn on a free local port in a thread of this process
    (the `verispec serve` runner, drain included): for tests that reach into the engine."""

    def __init__(self, app, drain_s: float = 5.0):
        import threading

        import uvicorn

        from .runner import DrainingServer

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=drain_s + 5)
        self.server = DrainingServer(config, app.state.worker, drain_s, "test")
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, timeout: float = 60) -> "ThreadServer":
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        return self

    def terminate(self) -> None:
        """What SIGTERM does to `verispec serve`: drain, then exit."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ThreadServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
