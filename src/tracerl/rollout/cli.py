"""``tracerl serve``: a local model behind an OpenAI-compatible endpoint, recording traces."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand."""
    serve = subparsers.add_parser(
        "serve",
        help="serve a local model over an OpenAI-compatible HTTP API and record token traces",
        description=(
            "Serve MODEL (a local transformers directory) at /v1/chat/completions, "
            "/v1/completions and /v1/models. Requests carrying the X-Tracerl-Session header "
            "(or the 'user' field) are recorded per session; POST "
            "/v1/sessions/KEY/finish writes the attempt with its ending and reward to --store."
        ),
    )
    serve.add_argument("--model", required=True, help="local model directory (config.json, "
                       "weights and tokenizer, e.g. one written by save_tiny)")
    serve.add_argument("--store", default=None,
                       help="trace store directory (default: record nothing to disk)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--name", default=None,
                       help="model name clients send (default: the directory's name)")
    serve.add_argument("--max-tokens", type=int, default=None,
                       help="completion length when a request names none (default: the "
                       "max_turn_tokens of the run that saved the model, else 256)")
    serve.add_argument("--seed", type=int, default=None,
                       help="seed of the stream that seeds requests without a seed")
    serve.add_argument("--policy-version", type=int, default=0,
                       help="policy version stamped on every sampled token")
    serve.add_argument("--max-batch-size", type=int, default=64,
                       help="most rows per forward pass (n choices of a request)")
    serve.add_argument("--log-level", default="warning",
                       choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise ValueError(f"serve needs the serve extra ({error.name} is missing): "
                         "pip install 'tracerl[serve]'") from None
    from tracerl.models.tiny import load_tiny
    from tracerl.rollout.policies.hf import HFPolicy
    from tracerl.rollout.serve.recorder import SessionRecorder
    from tracerl.rollout.serve.server import TracingServer, run_server
    from tracerl.rollout.settings import read_rollout
    from tracerl.trace.store import TraceStore

    # A policy saved by a tracerl run is served as its run decoded it.
    rollout = read_rollout(args.model)
    model, tokenizer = load_tiny(args.model)  # refuses non-finite weights
    policy = HFPolicy(model, tokenizer, policy_version=args.policy_version,
                      max_batch_size=args.max_batch_size)
    name = args.name or Path(args.model).resolve().name
    store = TraceStore(args.store) if args.store else None
    try:
        server = TracingServer(policy, SessionRecorder(store), model_name=name,
                               default_max_tokens=args.max_tokens, seed=args.seed,
                               rollout=rollout)
        print(f"tracerl serve: {name} at http://{args.host}:{args.port}/v1"
              + (f", traces to {args.store}" if args.store else ""), flush=True)
        if rollout is not None:
            print(f"  decoding as its run did: temperature {rollout.temperature}, top_p "
                  f"{rollout.top_p}, top_k {rollout.top_k}, {server.default_max_tokens} tokens "
                  f"per turn, tool-call grammar {'on' if rollout.constrain_calls else 'off'}",
                  flush=True)
        if server.not_applied:
            print(f"  not applied (they read the environment's files): "
                  f"{', '.join(server.not_applied)}", flush=True)
        run_server(server, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        if store is not None:
            store.close()
    return 0
