"""`verispec serve`: load the target and drafter, start the HTTP server."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible server with speculative decoding")
    s.add_argument("--model", default="gemma3-270m")
    s.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    s.add_argument("--drafter", default="ngram", help="ngram[:N] | layerskip:N | draft:PATH | none")
    s.add_argument("-k", "--num-draft-tokens", type=int, default=5)
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--device", default="cpu")
    s.add_argument("--max-batch-size", type=int, default=32, help="KV slots = requests decoded at once")
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--kv-cache-mb", type=float, default=None, help="KV memory budget; refuse to start if the slots need more")
    s.add_argument("--prefill-chunk", type=int, default=256)
    s.add_argument("--exact", action="store_true")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..cli import UserError
    from ..engine import LLM
    from ..kv import CacheFullError
    from ..models import ModelLoadError
    from .app import create_app

    try:
        llm = LLM(args.model, drafter=None if args.drafter in ("none", "") else args.drafter,
                  num_draft_tokens=args.num_draft_tokens, dtype=args.dtype, device=args.device,
                  max_batch_size=args.max_batch_size, max_model_len=args.max_model_len, kv_cache_mb=args.kv_cache_mb,
                  prefill_chunk=args.prefill_chunk, exact=args.exact)
    except (ModelLoadError, ValueError, CacheFullError) as e:
        raise UserError(str(e)) from e
    app = create_app(llm.engine, args.served_model_name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)
    return 0
