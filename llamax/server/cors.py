"""CORS for browser apps: which web pages may call the server (an ASGI middleware).

llama-server lets any origin call it (Access-Control-Allow-Origin: *): a page served from anywhere can
use a local server. `llamax serve --cors-origin ORIGIN` (repeatable) restricts that to the origins
named. A browser's preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered here,
204 with the methods and headers allowed, before the API key check (a preflight carries no
credentials); the real request that follows goes through the key check like any other, and its
answer, a 401 included, carries Access-Control-Allow-Origin so that the page can read it. A
preflight from an origin not allowed gets 403 with an OpenAI-style error body; other requests from
it are served without the CORS headers (the browser then withholds the answer from the page).
"""
from __future__ import annotations

import json
from collections.abc import Sequence

ALLOW_METHODS = b"GET, POST, OPTIONS"
MAX_AGE = b"600"  # seconds a browser may keep a preflight's answer


class CORS:
    """ASGI middleware: CORS headers on every answer to an allowed origin, preflights answered.

    Args:
        app: the ASGI app it wraps.
        origins: the allowed origins ("https://example.org", "http://localhost:5173"); None or "*"
            among them: any origin.
    """

    def __init__(self, app, origins: Sequence[str] | None = None) -> None:
        self.app = app
        if isinstance(origins, str):
            raise TypeError("origins: a list of origins, not one string")
        self.any = origins is None or "*" in origins
        self.origins = frozenset(o.rstrip("/").lower() for o in origins or ())

    def _allowed(self, origin: bytes) -> bool:
        return self.any or origin.decode("latin-1").rstrip("/").lower() in self.origins

    def _allow_origin(self, origin: bytes) -> list[tuple[bytes, bytes]]:
        if self.any:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            await self._preflight(origin, headers, send)
            return
        if not self._allowed(origin):
            await self.app(scope, receive, send)
            return
        extra = self._allow_origin(origin)

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, sending)

    async def _preflight(self, origin: bytes, headers: dict, send) -> None:
        if not self._allowed(origin):
            body = json.dumps({"error": {"message": f"origin {origin.decode('latin-1')} is not allowed "
                                         "(start the server with --cors-origin ORIGIN)",
                                         "type": "permission_error", "param": None, "code": 403}}).encode()
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        # the headers asked for (Authorization, Content-Type, ...): a "*" would not cover Authorization
        asked = headers.get(b"access-control-request-headers", b"")
        out = [*self._allow_origin(origin), (b"access-control-allow-methods", ALLOW_METHODS),
               (b"access-control-allow-headers", asked or b"*"), (b"access-control-max-age", MAX_AGE)]
        await send({"type": "http.response.start", "status": 204, "headers": out})
        await send({"type": "http.response.body", "body": b""})
