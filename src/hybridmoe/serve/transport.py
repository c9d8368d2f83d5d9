"""The server's connections, guarded as llama-server guards its own: a read/write timeout (`--timeout`, 600 s by
default: a client that stops sending a request it began, or stops reading its answer, is cut off after that
long) and a cap on open connections (`--max-connections`: those over it get a 503 to their first request, and
are closed). Malformed HTTP gets a 400 in the API's JSON error shape, as every other refusal does.

uvicorn alone times out only idle keep-alive connections: a connection that has sent part of a request head
(or of a body the app waits for) is held forever, and so is a stream to a client that no longer reads. Its
`limit_concurrency` answers in plain text. So `config` builds uvicorn's Config with a protocol of its own:
uvicorn's HTTP/1.1 protocol (h11 or httptools, as installed), plus a per-connection watchdog (and TCP_NODELAY,
which asyncio leaves off on some sockets)."""
from __future__ import annotations

import json
import socket

DEFAULT_TIMEOUT = 600.0        # llama-server's --timeout (read and write), seconds
DEFAULT_MAX_CONNECTIONS = 512
OVER_CAP_GRACE = 5.0           # a connection over the cap gets this long (at most) to send its request
KEEP_ALIVE = 5.0               # idle time between requests on a kept-alive connection (uvicorn's and httplib's)


def _error_body(path: str, status: int, message: str, code: str, type_: str) -> bytes:
    """An error in the shape of the API the path belongs to (Anthropic's under /v1/messages, else OpenAI's)."""
    from .anthropic import ERROR_TYPES, PATH
    if path == PATH or path.startswith(PATH + "/"):
        obj = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    else:
        obj = {"error": {"message": message, "type": type_, "code": code, "param": None}}
    return json.dumps(obj).encode()


def _over_cap_app(cap: int):
    async def app(scope, receive, send):
        body = _error_body(scope.get("path", ""), 503, f"the server has {cap} connections open, its limit "
                           f"(--max-connections); retry later", "too_many_connections", "server_error")
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})
    return app


def _no_delay(transport):
    """TCP_NODELAY on the connection. asyncio sets it only on sockets whose proto is IPPROTO_TCP, and a listening
    socket made as socket.socket(AF_INET, SOCK_STREAM) has proto 0, as do the sockets it accepts: then every
    answer written in two pieces (head, body; each event of a stream) waits for the client's delayed ACK,
    40 ms on Linux."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def guarded_protocol(base: type, timeout: float, max_connections: int) -> type:
    """uvicorn's HTTP protocol class `base` with the read/write timeout, the connection cap and JSON 400s."""

    class Guarded(base):
        def connection_made(self, transport):
            _no_delay(transport)
            super().connection_made(transport)
            self._hm_seen = self.loop.time()       # when a byte last came in
            self._hm_paused = None                 # since when the client has not taken what we write
            self._hm_closing = None                # since when the transport has been closing, flushing its buffer
            over = len(self.connections) > max_connections
            if over:                               # answered (503) and closed at its first request
                self.app = _over_cap_app(max_connections)
            self._hm_limit = min(timeout, OVER_CAP_GRACE) if over else timeout
            self._hm_timer = self.loop.call_later(self._hm_limit, self._hm_check)

        def data_received(self, data):
            self._hm_seen = self.loop.time()
            super().data_received(data)

        def pause_writing(self):
            self._hm_paused = self.loop.time()
            super().pause_writing()

        def resume_writing(self):
            self._hm_paused = None
            super().resume_writing()

        def on_response_complete(self):
            self._hm_seen = self.loop.time()       # the next request's time starts now
            super().on_response_complete()

        def connection_lost(self, exc):
            if self._hm_timer is not None:
                self._hm_timer.cancel()
                self._hm_timer = None
            super().connection_lost(exc)

        def _hm_stalled_since(self):
            """Since when the connection waits on the client (for request bytes, or to take the answer), or None
            while it waits on the server (a generation that is being computed). A closing transport (the keep-alive
            ended, or `Connection: close`) still writes what it holds: it gets the timeout to flush it."""
            if self._hm_paused is not None:
                return self._hm_paused
            if self.transport.is_closing():
                if self._hm_closing is None:
                    self._hm_closing = self.loop.time()
                return self._hm_closing
            cycle = self.cycle
            if cycle is None or getattr(cycle, "response_complete", True) or getattr(cycle, "more_body", False):
                return self._hm_seen               # no request yet, between requests, or in a request's body
            return None

        def _hm_check(self):
            self._hm_timer = None
            if self.transport is None:
                return
            now = self.loop.time()
            since = self._hm_stalled_since()
            if since is not None and now - since >= self._hm_limit:
                self.transport.abort()             # close() would wait to flush to a client that reads nothing
                return
            wait = since + self._hm_limit - now if since is not None else self._hm_limit / 4
            self._hm_timer = self.loop.call_later(max(wait, 0.05), self._hm_check)

        def send_400_response(self, msg: str) -> None:
            body = _error_body("", 400, f"invalid HTTP request: {msg.rstrip('.')}", "invalid_http",
                               "invalid_request_error")
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def config(app, *, timeout: float = DEFAULT_TIMEOUT, max_connections: int = DEFAULT_MAX_CONNECTIONS,
           keep_alive: float = KEEP_ALIVE, **kw):
    """uvicorn.Config for `app` with the guarded protocol (kw: uvicorn's other options); an idle kept-alive
    connection is closed after `keep_alive` seconds (at most the timeout)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    if not timeout > 0:
        raise ValueError(f"timeout {timeout}: give a positive number of seconds")
    if max_connections < 1:
        raise ValueError(f"max_connections {max_connections}: give at least 1")
    return uvicorn.Config(app, http=guarded_protocol(AutoHTTPProtocol, timeout, max_connections),
                          timeout_keep_alive=min(keep_alive, timeout), **kw)
