"""Who may do what: the clients' and the operators' bearer keys, and which worker URLs may join.

The router is a public front door. Clients send `--api-key`; management endpoints (adding, removing
and listing workers) need `--admin-api-key`, or, when only `--api-key` is set, the client key (a worker
that joins receives every client's prompts, so it never needs less than inference does); with no key
at all they answer only on a router bound to a loopback address. /health and /metrics stay open for
probes and scrapers. A worker sees only the request headers of an allow-list (upstream.py), never the
client's credentials; the router sends `--worker-api-key` instead.
"""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .workers import split_worker_url

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no key
MANAGEMENT_PATHS = frozenset({"/add_worker", "/remove_worker", "/list_workers"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def error_response(status: int, message: str) -> JSONResponse:
    """An error of the router's own, in the OpenAI error shape the workers use."""
    kind = {401: "authentication_error", 403: "permission_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "internal_server_error")
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status, headers=headers)


def bearer_matches(scope: Scope, key: bytes) -> bool:
    scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)


class RouterAccess:
    """ASGI middleware: the client key on forwarded routes, the admin key (or loopback) on management ones."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None, host: str):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        # the key management needs: the admin key, else the client key (None: no key is set at all)
        self.management_key = admin_api_key.encode() if admin_api_key else self.api_key
        self.loopback = is_loopback(host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            refusal.headers["Connection"] = "close"  # a body the request may still be sending is never read
            await refusal(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> JSONResponse | None:
        path = scope["path"]
        if path in OPEN_PATHS:
            return None
        if path in MANAGEMENT_PATHS:
            if self.management_key is None:
                if self.loopback:
                    return None
                return error_response(403, "management endpoints are off on a router bound to a non-loopback address "
                                       "without --admin-api-key: start it with --admin-api-key KEY")
            if not bearer_matches(scope, self.management_key):
                return error_response(401, "management endpoints need the router's admin key (--admin-api-key, or "
                                       "--api-key when no admin key is set) as 'Authorization: Bearer KEY'")
            return None
        if self.api_key is not None and not bearer_matches(scope, self.api_key):
            return error_response(401, "missing or invalid API key: send the router's key as 'Authorization: Bearer KEY'")
        return None


def management_access(api_key: str | None, admin_api_key: str | None, host: str) -> str:
    """The start-up sentence saying what /add_worker, /remove_worker and /list_workers need."""
    if admin_api_key:
        return "management endpoints (/add_worker, /remove_worker, /list_workers) need the admin key (--admin-api-key)"
    if api_key:
        return ("management endpoints (/add_worker, /remove_worker, /list_workers) need the client key (--api-key), "
                "as no --admin-api-key is set")
    if is_loopback(host):
        return ("management endpoints (/add_worker, /remove_worker, /list_workers) are open to every process of this "
                "machine (no key is set; the router is bound to a loopback address)")
    return "management endpoints (/add_worker, /remove_worker, /list_workers) are off (no --admin-api-key on a public address)"


class WorkerUrlRule:
    """`--worker-url-allow`: patterns a worker URL must match; none given allows any.

    A pattern is a URL whose parts are shell-style patterns (fnmatch), matched part by part: the
    scheme, the port, and the host label by label, so `http://10.0.0.*:*` allows http://10.0.0.7:30001
    but not http://10.0.0.evil.example:80. A host pattern of digits and wildcards only allows IP
    addresses (http://10.0.0.com:80 is no 10.0.0.* host). Before any pattern, the URL itself must be
    valid (workers.split_worker_url): a real host and a port that is a number in 1..65535.
    """

    def __init__(self, patterns: tuple[str, ...]):
        self.patterns = tuple(patterns)
        self._parts = [url_parts(p) for p in self.patterns]

    def refusal(self, url: str) -> str | None:
        """None when `url` may be a worker, else the sentence saying which rule refused it."""
        try:
            scheme, host, port = split_worker_url(url.strip().rstrip("/"))
        except ValueError as exc:
            return exc.args[0]
        parts = (scheme, host.split(".") if not host.startswith("[") else [host], str(port))
        if not self.patterns or any(parts_match(parts, p) for p in self._parts):
            return None
        return f"{url} matches none of --worker-url-allow {' '.join(self.patterns)}"


def url_parts(url: str) -> tuple[str, list[str], str]:
    """(scheme, host labels, port) of a pattern scheme://host[:port], the port spelled out when omitted."""
    scheme, _, rest = url.rstrip("/").partition("://")
    host, colon, port = rest.rpartition(":") if not rest.endswith("]") else (rest, "", "")
    if not colon or "]" in port:
        host, port = rest, {"http": "80", "https": "443"}.get(scheme.lower(), "")
    return scheme.lower(), host.lower().split("."), port


def parts_match(url: tuple[str, list[str], str], pattern: tuple[str, list[str], str]) -> bool:
    (scheme, labels, port), (scheme_p, labels_p, port_p) = url, pattern
    if "/" in port or any("/" in label for label in labels):  # a path: no worker URL (and no way around a rule)
        return False
    if labels_p[0].startswith("["):  # an IPv6 literal: brackets are no character class here
        return scheme == scheme_p and labels == labels_p and fnmatch.fnmatchcase(port, port_p)
    if not (fnmatch.fnmatchcase(scheme, scheme_p) and fnmatch.fnmatchcase(port, port_p)):
        return False
    if len(labels) != len(labels_p) or not all(fnmatch.fnmatchcase(a, b) for a, b in zip(labels, labels_p)):
        return False
    numeric = all(label.strip("*?").isdigit() or not label.strip("*?") for label in labels_p)
    return not numeric or all(label.isdigit() for label in labels)
