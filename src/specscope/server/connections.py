"""The server's connections, below the app: what uvicorn leaves unbounded.

- A request head (request line and headers) must arrive whole within `header_timeout` s of the connection opening
  or of its first byte on a kept-alive connection; a client that sends half a header is answered 408 and dropped, one
  that sends nothing is dropped. (The body has its own limit, --body-timeout, in app.read_body; uvicorn's keep-alive
  timeout closes idle kept-alive connections.)
- At most `cap` connections are open; one more is answered 503 with Retry-After at once and closed, so a flood of
  idle connections cannot take the file descriptors a real request needs (with them gone, the kernel queues new
  connections unanswered and asyncio logs "Too many open files"). The cap fits the process's RLIMIT_NOFILE.
- `ListeningServer` says "listening" only once its sockets accept.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import dataclass, field

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specscope.server.protocol import ApiError

log = logging.getLogger("specscope.server")

DEFAULT_MAX_CONNECTIONS = 1024
TURNED_AWAY_LINGER_S = 2.0   # a refused client's time to read its 503 before its connection is cut


def fd_limit() -> int:
    """The process's open-file limit, its soft limit raised to the hard one first (as vLLM does at start-up)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 16


@dataclass(frozen=True)
class Limits:
    """How many connections a server serves (`cap`), how many turned-away ones may linger, and how many one accept
    burst takes (asyncio accepts up to `backlog` before any is seen): together, with the process's own files,
    within its open-file limit."""
    cap: int
    linger_max: int
    backlog: int


OWN_FILES = 32   # the process's own descriptors while serving (8 measured with a tiny model): logs, caches, pipes


def connection_limits(wanted: int, nofile: int) -> Limits:
    """`wanted` connections (--max-connections), lowered to fit `nofile` descriptors."""
    backlog = min(2048, max(16, nofile // 8))
    linger = min(256, max(8, nofile // 16))
    return Limits(max(1, min(wanted, nofile - backlog - linger - OWN_FILES)), linger, backlog)


def _raw_response(status: int, reason: str, e: ApiError, headers: dict[str, str]) -> bytes:
    body = json.dumps(e.body()).encode()
    head = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close", **headers}
    return (f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n").encode() \
        + body


@dataclass
class Gate:
    """One server's connection limits and the connections it is turning away."""
    header_timeout: float = 10.0
    cap: int = DEFAULT_MAX_CONNECTIONS
    # turned-away connections still open (reading their 503); past `linger_max` the oldest is cut at once, so a
    # flood holds at most cap + linger_max descriptors
    linger_max: int = 64
    lingering: dict = field(default_factory=dict)
    refused: int = 0            # since the last log line
    logged_at: float = -1e9


class GuardedH11(H11Protocol):
    """uvicorn's h11 connection with a deadline for each request head and a cap on open connections (`gate`, set by
    `guarded_protocol` for one server)."""

    gate = Gate()

    def connection_made(self, transport) -> None:
        self.head_timer = None
        self.refused = False
        super().connection_made(transport)
        if len(self.connections) - len(self.gate.lingering) > self.gate.cap:
            self._turn_away()
        else:
            self._watch_head()

    def _turn_away(self) -> None:
        """503 before reading anything, then half-close: the client reads the answer and closes (or is cut off)."""
        g = self.gate
        self.refused = True
        e = ApiError(503, f"the server has {g.cap} connections open, its limit; retry in a second")
        self.transport.write(_raw_response(503, "Service Unavailable", e, {"retry-after": "1"}))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.head_timer = self.loop.call_later(TURNED_AWAY_LINGER_S, self.transport.close)
        g.lingering[self] = None
        if len(g.lingering) > g.linger_max:
            oldest = next(iter(g.lingering))
            del g.lingering[oldest]
            oldest.transport.abort()
        g.refused += 1
        if time.monotonic() - g.logged_at > 10:   # one line per 10 s, not one per connection of a flood
            log.warning("new connections answered 503 (%d since the last such line): %d open, the limit "
                        "(--max-connections, or what the open-file limit leaves)", g.refused, g.cap)
            g.refused, g.logged_at = 0, time.monotonic()

    def data_received(self, data: bytes) -> None:
        if self.refused:   # answered already; what the client sends is read and dropped
            return
        super().data_received(data)
        self._watch_head()

    def _watch_head(self) -> None:
        """The head deadline runs while a request head is awaited (h11: the client's state IDLE)."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self.head_timer is None:
            self.head_timer = self.loop.call_later(self.gate.header_timeout, self._head_timed_out)
        elif not waiting and self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        partial = bool(self.conn.trailing_data[0])
        if partial:   # half a head: say why; a connection that sent nothing is just closed (as nginx does)
            log.info("%s: no whole request head within %g s; closing", self.client, self.gate.header_timeout)
            e = ApiError(408, f"the request head did not arrive within {self.gate.header_timeout:g} s; send it whole "
                              f"and promptly")
            self.transport.write(_raw_response(408, "Request Timeout", e, {}))
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self.gate.lingering.pop(self, None)
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        super().connection_lost(exc)


def guarded_protocol(header_timeout: float, limits: Limits) -> type[GuardedH11]:
    """The connection class for one server (uvicorn.Config(http=..., backlog=limits.backlog))."""
    return type("GuardedH11", (GuardedH11,), {"gate": Gate(header_timeout, limits.cap, limits.linger_max)})


class ListeningServer(uvicorn.Server):
    """uvicorn's server that calls `on_listening` once its sockets accept (not when they are bound: a client told
    the URL earlier could be refused)."""

    def __init__(self, config: uvicorn.Config, on_listening):
        super().__init__(config)
        self.on_listening = on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.on_listening()
