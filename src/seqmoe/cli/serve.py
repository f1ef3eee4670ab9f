"""`seqmoe serve`: an OpenAI-compatible HTTP server for an offloaded MoE model (src/seqmoe/serve/).

    seqmoe serve --model seqmoe-tiny --residency 0.3 --system on-demand-lru --port 8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "seqmoe-tiny", "prompt": "def parse(", "max_tokens": 32}'

The model is loaded once on the CPU and offloaded as `seqmoe generate` does (same flags); one
batcher thread decodes up to `--max-batch` requests together, the others wait in a queue (`--queue-limit`; who
leaves it first: `--admission`).
`add_serve_commands(subparsers)` registers the command (src/seqmoe/cli/__init__.py). Bad input raises
`UserError`; fastapi and uvicorn are the `serve` extra and are imported only when it runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

from seqmoe.arch.model_dirs import max_positions, resolve_model_dir
from seqmoe.base.errors import UserError, needs_extra
from seqmoe.brain.admission import ADMISSIONS, CANDIDATES, MAX_SKIPS  # not serve.admission: it loads torch
from seqmoe.cli.args import progress
from seqmoe.cli.runtime import add_offload_flags, offload_configs
from seqmoe.serve.limits import Limits


def add_serve_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve` to the main parser's subparsers."""
    s = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming) for an offloaded model",
        description="Load a MoE causal LM once, offload its routed experts (C = floor(R x L x E) device slots managed "
        "by --system) and serve GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true as "
        "server-sent events) and GET /stats. Up to --max-batch requests decode together; the others wait in a queue "
        "(who leaves it first: --admission).",
    )
    add_offload_flags(s)
    s.add_argument("--eager", action="store_true", help="decode the running batch in a cache that grows with it, "
                   "eagerly (default: one static cache of --max-batch rows and the context length, whose decode step "
                   "is captured as one CUDA graph per number of rows on cuda with --control thread, the default there)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free port, printed)")
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together: they join and leave the "
                   "running batch between decode steps (continuous batching); 1: one at a time. One at a time anyway "
                   "for a model whose cache has sliding-window layers (default: 8)")
    s.add_argument("--admission", default="fifo", help="which waiting request takes a free row of the batch: "
                   f"{' or '.join(ADMISSIONS)} (the one whose forecast routing overlaps most with the running batch's "
                   f"and the resident experts, among the first {CANDIDATES} waiting; the oldest is passed over at most "
                   f"{MAX_SKIPS} times in a row) (default: fifo)")
    s.add_argument("--queue-limit", type=int, default=32, help="requests that may wait beside the running batch; "
                   "past it the server answers 429 (default: 32)")
    s.add_argument("--context-length", type=int, default=None, help="prompt + completion tokens at most (default: the "
                   "model's max_position_embeddings)")
    s.add_argument("--chat-template", metavar="FILE", help="Jinja chat template for /v1/chat/completions (default: "
                   "the tokenizer's; without one, chat requests get a 400)")
    s.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: the --model "
                   "folder's name)")
    s.add_argument("--api-key", metavar="KEY", default=os.environ.get("SEQMOE_API_KEY"), help="every route but "
                   "/health needs the header Authorization: Bearer KEY (a 401 otherwise) (default: $SEQMOE_API_KEY; "
                   "unset: open, with a warning when --host is not a loopback address)")
    s.add_argument("--max-body-bytes", type=int, default=Limits.max_body, help="a longer request body is a 413 "
                   f"(default: {Limits.max_body})")
    s.add_argument("--stall-timeout", type=float, default=Limits.stall_s, metavar="S", help="a streaming client "
                   f"that leaves tokens unread this long has its request cancelled and its row freed (default: "
                   f"{Limits.stall_s:g})")
    s.add_argument("--request-timeout", type=float, default=Limits.request_timeout_s, metavar="S", help="a request "
                   "still running after this many seconds is cancelled: a 504, or an error event in a stream "
                   "(default: none)")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="S", help="on SIGTERM: new requests get a "
                   "503, running ones finish for at most this long, then the server exits 0 (SIGINT: at once) "
                   "(default: 30)")
    s.add_argument("--replicas", type=int, default=1, metavar="N", help="serve N replicas of the server (each loads "
                   "the model, with its own device, runtime, batcher and /metrics) behind Ray Serve's HTTP proxy, "
                   "which spreads requests over them and replaces a replica that dies; needs pip install "
                   "'seqmoe[serve,ray]'. Each replica gets this machine's cores / N, or --threads cores on a "
                   "cluster (default: 1, one process without Ray)")
    s.add_argument("--ray", nargs="?", const="", metavar="ADDRESS", help="run the replicas on the Ray cluster at "
                   "ADDRESS (auto, host:port or ray://host:10001; seqmoe installed on every node; a Ray Serve already "
                   "running there keeps its own --host and --port); with no ADDRESS, on a Ray started here (default "
                   "with --replicas above 1)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default: info: one line per request)")
    s.set_defaults(func=run_serve)


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.admission not in ADMISSIONS:
        raise UserError(f"--admission must be one of {', '.join(ADMISSIONS)}, got {args.admission!r}")
    if args.queue_limit < 0:
        raise UserError(f"--queue-limit must be >= 0, got {args.queue_limit}")
    if args.context_length is not None and args.context_length < 2:
        raise UserError(f"--context-length must be >= 2, got {args.context_length}")
    limit = max_positions(resolve_model_dir(args.model))
    if args.context_length is not None and limit is not None and args.context_length > limit:
        raise UserError(f"--context-length {args.context_length} is past {args.model}'s context of {limit} positions "
                        f"(max_position_embeddings); give at most {limit}")
    for flag in ("max_body_bytes", "stall_timeout", "request_timeout", "drain_timeout"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise UserError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty; give a key, or leave it out for an open server")
    if args.chat_template and not Path(args.chat_template).is_file():
        raise UserError(f"no chat template file at {args.chat_template}")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)  # connections made once "serving" is printed wait for uvicorn instead of being refused
    sock.set_inheritable(True)
    return sock


def run_serve(args) -> int:
    load, cfg = offload_configs(args)
    _check_args(args)
    try:
        import uvicorn  # uvicorn: only when this runs

        from seqmoe.serve.api import create_app  # fastapi, torch: only when this runs
        from seqmoe.serve.lifecycle import DrainingServer  # uvicorn: only when this runs
    except ImportError as e:
        raise needs_extra("seqmoe serve needs fastapi and uvicorn", "serve", e) from None
    from seqmoe.serve.startup import start_batcher  # torch: only when this runs

    start = dict(eager=args.eager, queue_limit=args.queue_limit, max_batch=args.max_batch, admission=args.admission,
                 context_length=args.context_length, chat_template=args.chat_template, name=args.served_model_name)
    limits = Limits(max_body=args.max_body_bytes, stall_s=args.stall_timeout, request_timeout_s=args.request_timeout)
    replicas = args.replicas != 1 or args.ray is not None
    if replicas:  # a bad count or split of the cores is refused here
        from seqmoe.serve.replicas import replica_spec, serve_replicas

        load, spec = replica_spec(load, cfg, args.replicas, args.ray or None, drain_timeout=args.drain_timeout,
                                  log_level=args.log_level, start=start,
                                  app={"api_key": args.api_key, "limits": limits})
    sock = _bind(args.host, args.port)  # before loading: a busy port fails at once
    host, port = sock.getsockname()[:2]
    if args.api_key is None and not _loopback(host):
        print(f"seqmoe: warning: {host} is reachable beyond this machine and the server has no API key: anyone who "
              "reaches the port can use it (give --api-key or $SEQMOE_API_KEY)", file=sys.stderr, flush=True)
    if replicas:
        sock.close()  # the port is free (or was chosen) and Ray Serve's proxy takes it
        return serve_replicas(load, cfg, spec, host=host, port=port, address=args.ray or None)
    served = start_batcher(load, cfg, progress=progress(args), **start)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    print(f"seqmoe: serving {served.name} on {url}/v1 ({served.summary}); stats at {url}/stats", file=sys.stderr,
          flush=True)
    app = create_app(served.batcher, served.tokenizer, model_name=served.name, context_length=served.context_length,
                     temperature=served.temperature, top_p=served.top_p, api_key=args.api_key, limits=limits)
    server = DrainingServer(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5),
                            api=app.state.api, drain_timeout=args.drain_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        served.close()
        sock.close()
    if server.interrupted:
        print("seqmoe: interrupted; the server stopped", file=sys.stderr)
        return 130
    return 0


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
