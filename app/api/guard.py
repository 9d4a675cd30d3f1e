"""Keeps other web sites out: every HTTP and websocket request (the page, socket.io, sign-in, history,
the API) is checked before Chainlit or the API sees it.

- `Host`: a DNS-rebinding page points a name of its own at 127.0.0.1, and its requests then name
  that host. Only loopback names and addresses and LLAMA_ALLOWED_HOSTS pass; others get 421.
- `Origin`: a browser names the page that makes a request. Only the app's own origins (this
  server's scheme and port with a host name it answers to) and LLAMA_ALLOWED_ORIGINS pass; any
  other page gets 403, so a site the user visits can neither use the model nor read the history.
  Requests without an Origin pass (curl, the openai SDK, other servers): browsers always send one
  when a page of another site asks.

Listening on an address other machines reach (e.g. `--host 0.0.0.0`) needs LLAMA_ALLOWED_HOSTS, the
names they reach this one by. CORS answers (from Chainlit's CORS middleware) name only allowed origins.

Written by hand rather than with Starlette's TrustedHostMiddleware: its refusal is a bare "Invalid
host header" that does not say what to set; and no maintained middleware refuses a foreign Origin
(CORS middleware only leaves the answer unreadable, the request still runs).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from app.settings import Settings, SettingsError

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 80, "https": 443}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # the names of this computer a browser may use
HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?")  # as DNS names appear in Host headers (IDNA encoded)
MAX_LOGGED = 256  # distinct refused hosts and origins logged (each once), so a flood cannot fill the log

Origin = tuple[str, str, int]  # (scheme, host, port): ("http", "localhost", 8000); IPv6 hosts without brackets


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_origin(text: str) -> Origin | None:
    """'http://LocalHost:8000' -> ('http', 'localhost', 8000); None unless it is http(s)://host[:port]."""
    try:
        url = urlsplit(text.strip())
        port = url.port
    except ValueError:  # a port that is not a number, a bad IPv6 literal
        return None
    if (url.scheme not in DEFAULT_PORTS or not url.hostname or url.path not in ("", "/") or url.query
            or url.fragment or url.username is not None):
        return None
    return url.scheme, url.hostname, port or DEFAULT_PORTS[url.scheme]


def origin_text(origin: Origin) -> str:
    """As browsers write it in the Origin header: no default port, IPv6 in brackets."""
    scheme, host, port = origin
    return f"{scheme}://{bracketed(host)}" + ("" if port == DEFAULT_PORTS[scheme] else f":{port}")


def bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address, as URLs and Host headers write it


def host_name(header: str) -> str | None:
    """A Host header's name: 'LocalHost:8000' -> 'localhost', '[::1]:8000' -> '::1'; None if malformed."""
    try:
        url = urlsplit("//" + header)
        url.port  # noqa: B018 (raises for a port that is not a number)
    except ValueError:
        return None
    if not url.hostname or url.username is not None or url.path or url.query or url.fragment:
        return None
    return url.hostname


@dataclass(frozen=True)
class Allowed:
    """Who may send requests: the host names they may name, and the pages (origins) they may come from."""

    scheme: str
    port: int
    hosts: tuple[str, ...] = ()  # besides loopback names and addresses
    origins: tuple[Origin, ...] = ()  # besides the app's own

    @classmethod
    def from_settings(cls, settings: Settings, listen_host: str, port: int, scheme: str = "http") -> Allowed:
        """For a server listening on listen_host:port; SettingsError for a bad entry of
        LLAMA_ALLOWED_HOSTS or LLAMA_ALLOWED_ORIGINS, or for a non-loopback address without the former."""
        hosts = tuple(_host_entry(entry) for entry in settings.allowed_hosts)
        if not is_loopback(listen_host) and not hosts:
            raise SettingsError(
                f"listening on {listen_host} (--host or CHAINLIT_HOST) lets other machines connect: set "
                "LLAMA_ALLOWED_HOSTS to the names or addresses they reach this one by, comma-separated (e.g. "
                f"LLAMA_ALLOWED_HOSTS={socket.gethostname().lower()},192.168.1.20); requests naming any other host "
                "are refused")
        origins = []
        for entry in settings.allowed_origins:
            origin = parse_origin(entry)
            if origin is None:
                raise SettingsError(f"LLAMA_ALLOWED_ORIGINS={','.join(settings.allowed_origins)}: {entry!r} is not "
                                    "an origin: expected scheme://host[:port] entries, e.g. http://localhost:3000")
            origins.append(origin)
        return cls(scheme, port, hosts, tuple(origins))

    def host_names(self) -> tuple[str, ...]:
        """The names a request may use for this server (any loopback address passes too)."""
        return (*LOOPBACK_HOSTS, *self.hosts)

    def host_ok(self, host: str) -> bool:
        return is_loopback(host) or host in self.hosts

    def origin_ok(self, origin: Origin) -> bool:
        scheme, host, port = origin
        return origin in self.origins or (scheme == self.scheme and port == self.port and self.host_ok(host))

    def own_origins(self) -> list[str]:
        return [origin_text((self.scheme, host, self.port)) for host in self.host_names()]

    def summary(self) -> str:
        """For the start-up log."""
        return (f"accepting requests for the hosts {', '.join(map(bracketed, self.host_names()))} "
                f"from pages of {', '.join(self.cors_origins())} (and from clients that name no page)")

    def cors_origins(self) -> list[str]:
        """Every allowed origin that can be named (loopback addresses beyond LOOPBACK_HOSTS cannot)."""
        return self.own_origins() + [origin_text(origin) for origin in self.origins]

    def refusal(self, headers: Headers) -> tuple[int, str, str] | None:
        """(status, message, what was refused) for a request that may not pass, else None."""
        header = headers.get("host")
        host = host_name(header or "")
        if host is None:
            return 400, f"Bad request: expected a Host header naming this server, found {header!r}.", f"host {header!r}"
        if not self.host_ok(host):
            names = ", ".join(map(bracketed, self.host_names()))
            return 421, (f"Misdirected request: this server answers to {names}, not to the host {host!r} "
                         "(a web page may have pointed a name of its own at this computer). To reach it by "
                         f"that name, set LLAMA_ALLOWED_HOSTS={host}."), f"host {host!r}"
        text = headers.get("origin")
        if text is None:
            return None
        origin = parse_origin(text)
        if origin is not None and self.origin_ok(origin):
            return None
        allowed = ", ".join(self.cors_origins())
        advice = f" To allow it, set LLAMA_ALLOWED_ORIGINS={origin_text(origin)}." if origin else ""
        return 403, (f"Forbidden: this server answers only its own pages ({allowed}), not a page of the "
                     f"origin {text!r}.{advice}"), f"origin {text!r}"


def _host_entry(entry: str) -> str:
    """A LLAMA_ALLOWED_HOSTS entry as host_name() reads it from a Host header: lowercase, IPv6 without brackets."""
    try:
        return str(ipaddress.ip_address(entry.strip("[]")))
    except ValueError:
        pass
    if not HOST_NAME.fullmatch(entry.lower()):
        raise SettingsError(f"LLAMA_ALLOWED_HOSTS: {entry!r} is not a host name or address: expected names such as "
                            "mybox.lan or 192.168.1.20, comma-separated, without scheme or port")
    return entry.lower()


# Every answer says that no other page may show it in a frame (clickjacking: a page of another site drawing the
# chat under its own buttons): the old header and the CSP directive that replaced it, for every browser.
FRAME_HEADERS = [(b"x-frame-options", b"DENY"), (b"content-security-policy", b"frame-ancestors 'none'")]


API_PATHS = ("/v1/", "/api/")  # OpenAI's and Ollama's routes: each answer with an x-request-id


class Guard:
    """ASGI middleware: a request with a foreign Host (421) or Origin (403) is answered here, and goes no
    further; a websocket handshake is refused with the same status. Every HTTP answer gets FRAME_HEADERS (a
    response that sets its own Content-Security-Policy keeps it), and an API answer an `x-request-id`."""

    def __init__(self, app: ASGIApp, allowed: Allowed):
        self.app, self.allowed = app, allowed
        self.logged: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        api = scope.get("path", "").startswith(API_PATHS)

        async def framed(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                headers += [h for h in FRAME_HEADERS if h[0] not in names]
                if api and b"x-request-id" not in names:  # as OpenAI's API answers: an id per request, for logs
                    headers.append((b"x-request-id", f"req_{uuid.uuid4().hex}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        refused = self.allowed.refusal(Headers(scope=scope))
        if refused is not None:
            status, message, what = refused
            self._log(what, message)
            await PlainTextResponse(message, status_code=status)(scope, receive, framed)
            return
        await self.app(scope, receive, framed if scope["type"] == "http" else send)

    def _log(self, what: str, message: str) -> None:
        if what not in self.logged and len(self.logged) < MAX_LOGGED:
            self.logged.add(what)
            log.warning("refused a request (logged once per %s): %s", what, message)


def install(app, allowed: Allowed) -> None:
    """Put the Guard in front of everything a Starlette or FastAPI app serves (mounted apps such as
    socket.io included) and have CORS answer only allowed origins: Chainlit's CORS middleware, made
    from .chainlit/config.toml's allow_origins, gets them; an app without one gets Starlette's."""
    cors = [middleware for middleware in app.user_middleware if middleware.cls is CORSMiddleware]
    for middleware in cors:
        middleware.kwargs["allow_origins"] = allowed.cors_origins()
    if not cors:
        app.add_middleware(CORSMiddleware, allow_origins=allowed.cors_origins(), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(Guard, allowed=allowed)  # added last: the outermost
