"""OpenAI-compatible serving: HTTP API (app.py), engine thread (worker.py), metrics, stop strings."""

from .app import create_app

__all__ = ["create_app"]
