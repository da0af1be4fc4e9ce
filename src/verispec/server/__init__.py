"""OpenAI-compatible serving: HTTP API (app.py), engine thread (worker.py), metrics, stop strings.

`create_app` is imported on first use: `verispec serve`'s parser lives in this package and must
not pull in torch and FastAPI when `verispec --help` runs."""


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["create_app"]
