"""`hybridmoe serve`: an OpenAI-compatible HTTP server (llama.cpp's llama-server)."""
from __future__ import annotations

import os
import socket
import sys

from .. import env
from ..errors import warn
from ..serve.transport import DEFAULT_MAX_CONNECTIONS, DEFAULT_TIMEOUT
from .common import (
    add_model_args,
    add_runtime_args,
    add_template_args,
    add_warmup_arg,
    freeze_heap,
    runtime_kwargs,
    template_setup,
    warmup,
)


def setup_arg_parser(p):
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s; 0.0.0.0 listens on every interface)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s; 0: any free port)")
    p.add_argument("-a", "--alias", default=None, help="model name shown by /v1/models and in responses "
                   "(default: the model's file name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $HYBRIDMOE_API_KEY, else no key)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="API keys, one a line (any one is accepted), as llama-server's")
    p.add_argument("-n", "--n-predict", type=int, default=-1, metavar="N",
                   help="the most tokens a reply may have when the request sets no max_tokens (default -1: until "
                        "the context is full)")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="folder where POST /slots/0?action=save|restore keep KV caches (llama-server's)")
    p.add_argument("--metrics", action="store_true",
                   help="serve GET /metrics (Prometheus text, llama-server's metric names)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body, in MiB (default: 8)")
    p.add_argument("-to", "--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="N",
                   help="llama-server's read/write timeout: a client that stops sending a request it began, or "
                        "stops reading its answer, is cut off after N seconds (default: %(default)g)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open connections at most; more get a 503 to their first request (default: %(default)s)")
    p.add_argument("--reasoning-format", default="auto", choices=["auto", "deepseek", "none"],
                   help="llama-server's: auto and deepseek return a reply's <think>...</think> as "
                        "reasoning_content, none leaves it in the content (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level; 'warning' hides the request log (default: %(default)s)")
    add_runtime_args(p)
    # -np / --parallel act here: they replace the no-op compatibility flags the placement options register
    g = p.add_argument_group("slots and continuous batching (llama-server's)", conflict_handler="resolve")
    g.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                   help="slots: requests generated at once, batched step by step (continuous batching), each slot "
                        "with its own KV cache of -c / N tokens (default: %(default)s)")
    g.add_argument("-kvu", "--kv-unified", action="store_true",
                   help="every slot may use the whole -c; the requests running at once share it (each slot's "
                        "cache is allocated at the full size when first used)")
    g.add_argument("-sps", "--slot-prompt-similarity", type=float, default=0.5, metavar="F",
                   help="a request goes to the idle slot whose cached prompt it shares more than this fraction of "
                        "(the longest such prefix), else to the least recently used (default: %(default)s; 0: off)")
    add_template_args(p)
    add_warmup_arg(p)


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket bound to host:port (bound before the model loads, so a port in use fails fast)."""
    from ..errors import HybridMoeError
    if not 0 <= port <= 65535:
        raise HybridMoeError(f"--port {port}: give a port between 0 and 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise HybridMoeError(f"--host {host}: cannot resolve the address ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)        # connections made while the model loads wait in the backlog
    except OSError as e:
        sock.close()
        raise HybridMoeError(f"cannot listen on {host}:{port}: {e.strerror} (is another server running there? "
                             f"pick another --port)") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def api_keys(args) -> list[str]:
    """--api-key, the keys of --api-key-file (one a line; blank lines and # comments skipped), else
    $HYBRIDMOE_API_KEY."""
    from ..errors import HybridMoeError
    keys = [args.api_key] if args.api_key else []
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                keys += [k.strip() for k in f if k.strip() and not k.strip().startswith("#")]
        except OSError as e:
            raise HybridMoeError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror}") from None
        if not keys:
            raise HybridMoeError(f"--api-key-file {args.api_key_file} holds no key")
    if not keys and env.get("HYBRIDMOE_API_KEY"):
        keys = [env.get("HYBRIDMOE_API_KEY")]
    return keys


def slot_folder(path: str | None) -> str | None:
    """--slot-save-path: the folder (made if missing), or None."""
    if path is None:
        return None
    from ..errors import HybridMoeError
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise HybridMoeError(f"--slot-save-path {path}: {e.strerror}") from None
    return os.path.abspath(path)


def main(args) -> int:
    import uvicorn

    import hybridmoe

    from ..errors import HybridMoeError
    from ..serve import transport
    from ..serve.app import create_app

    if args.max_body_mb <= 0:
        raise HybridMoeError(f"--max-body-mb {args.max_body_mb}: give a positive size")
    if not args.timeout > 0:
        raise HybridMoeError(f"--timeout {args.timeout}: give a positive number of seconds")
    if args.max_connections < 1:
        raise HybridMoeError(f"--max-connections {args.max_connections}: give at least 1")
    api_key = api_keys(args)
    if args.n_predict == 0 or args.n_predict < -1:
        raise HybridMoeError(f"-n {args.n_predict}: give a positive number of tokens, or -1 for no limit")
    if args.parallel < 1:
        raise HybridMoeError(f"-np {args.parallel}: give at least 1 slot")
    if not 0 <= args.slot_prompt_similarity <= 1:
        raise HybridMoeError(f"--slot-prompt-similarity {args.slot_prompt_similarity}: give a number from 0 to 1")
    sock = bind(args.host, args.port)
    try:
        model = hybridmoe.load(args.model, **runtime_kwargs(args))
        print(f"loaded {model.cfg.name} ({model.cfg.arch}, {model.file.nbytes / 2**30:.2f} GiB) "
              f"in {model.load_seconds:.2f} s", file=sys.stderr)
        template_kwargs = template_setup(model, args)
        warmup(model, args, prompt_sizes=True)
        app = create_app(model, args.alias, api_key=api_key, max_body_bytes=int(args.max_body_mb * 2**20),
                         reasoning_format=args.reasoning_format, metrics=args.metrics,
                         slot_save_path=slot_folder(args.slot_save_path), template_defaults=template_kwargs,
                         n_parallel=args.parallel, kv_unified=args.kv_unified,
                         slot_similarity=args.slot_prompt_similarity)
        state = app.state.hybridmoe
        state.n_predict = args.n_predict
        if not args.no_warmup:
            print(f"warming up the {len(state.batcher.slots)} slot(s) (each slot's decode step, each batch size of "
                  "the batched step, which also runs short prompts) ...", file=sys.stderr, flush=True)
            print(f"slots warmed up in {state.batcher.warm_slots():.2f} s", file=sys.stderr)
        freeze_heap()                                   # the model's, the slots' caches and the app's objects
        url = url_of(sock)
        n_slots = len(state.batcher.slots)
        slots = f" in {n_slots} slots ({state.n_ctx_slot} each)" if n_slots > 1 else ""
        print(f"model {state.name!r}, context {state.n_ctx} tokens{slots}; server is listening on {url}  "
              f"(OpenAI base_url: {url}/v1)", flush=True)
        if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
            warn("listening beyond this machine without --api-key: anyone who can reach the port "
                 "can use the model")
        config = transport.config(app, timeout=args.timeout, max_connections=args.max_connections,
                                  log_level=args.log_level, timeout_graceful_shutdown=5)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:
            pass            # uvicorn shuts down gracefully on Ctrl-C, then raises the signal again
        print("server stopped", file=sys.stderr)
    finally:
        sock.close()
    return 0
