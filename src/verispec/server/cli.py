"""`verispec serve`: load the target and drafter, start the HTTP server, drain it on SIGTERM."""

from __future__ import annotations

import argparse
import sys

from ..options import engine_options

DESCRIPTION = """\
An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics) that decodes with speculative decoding: every output is what the target alone gives.
Requests join the running batch at every step. On SIGTERM or Ctrl-C the server stops taking
requests, lets running ones finish for up to --drain-timeout seconds, ends the rest with
finish_reason "abort" (streams still get [DONE]) and exits."""


DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: ~250k tokens of text, far beyond any context served here
DEFAULT_MAX_PROMPTS = 64


def add_parser(sub) -> None:
    s = sub.add_parser("serve", parents=[engine_options(per_request=True)],
                       help="OpenAI-compatible server with speculative decoding", description=DESCRIPTION)
    s.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    s.add_argument("--max-batch-size", type=int, default=32, help="KV slots = requests decoded at once; more wait")
    s.add_argument("--kv-cache-mb", type=float, default=None, help="KV memory budget; refuse to start if the slots need more")
    s.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per engine step, over all requests")
    s.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies are refused at once (413)")
    s.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS,
                   help="prompts in one /v1/completions request (a list of strings)")
    s.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds running requests may go on after SIGTERM before they are ended")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .. import preflight
    from ..errors import UserError
    from ..threads import setup_threads

    for name in ("max_request_bytes", "max_prompts_per_request"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.drain_timeout < 0:
        raise UserError("--drain-timeout must be >= 0")
    setup_threads(args.threads)
    preflight.device(args.device)
    cfg = preflight.model_config(args.model, args.dtype)
    max_len = preflight.max_model_len(args.max_model_len, cfg, args.model)
    if hint := preflight.precision_hint(args.dtype, args.quant, args.device):
        print(hint, file=sys.stderr)

    from ..chat import turn_end_ids
    from ..engine import LLM
    from ..kv import CacheFullError
    from ..models import ModelLoadError, hf_folder
    from .app import ServerLimits, create_app
    from .runner import DrainingServer

    try:
        llm = LLM(args.model, drafter=None if args.drafter in ("none", "") else args.drafter,
                  num_draft_tokens=args.num_draft_tokens, draft_tree=args.tree, draft_policy=args.draft_policy, dtype=args.dtype, quant=args.quant, device=args.device,
                  max_batch_size=args.max_batch_size, max_model_len=max_len, kv_cache_mb=args.kv_cache_mb,
                  prefill_chunk=args.prefill_chunk, exact=args.exact)
        stop_ids = turn_end_ids(llm.tokenizer, llm.engine.model.config.model_type, hf_folder(args.model))
    except (ModelLoadError, ValueError, CacheFullError) as e:
        raise UserError(str(e)) from e
    name = args.served_model_name or args.model
    app = create_app(llm.engine, name, ServerLimits(args.max_request_bytes, args.max_prompts_per_request), stop_ids)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.drain_timeout + 5)
    server = DrainingServer(config, app.state.worker, args.drain_timeout, name, llm.engine.drafter)
    server.run()
    return 0
