"""Client API keys: who may use the proxy.

Keys are compared with `hmac.compare_digest` against every configured key, with no early exit,
so the time an answer takes says nothing about how much of a guess was right. Keys never appear
in logs or reprs: the proxy logs no request headers, and `ApiKeys` prints only how many it holds.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from powerbatch.errors import ConfigError
from powerbatch.proxy.dialects import OPENAI

# Liveness and readiness probes stay open: orchestrators call them without credentials.
PUBLIC_PATHS = frozenset({"/health", "/ready"})
# A comment runs from `#` at the start of a line or after whitespace to the end of the line.
_COMMENT = re.compile(r"(^|\s)#.*$")


# `name:key` gives a key a tenant name (the label its usage and energy are counted under).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
DEFAULT_TENANT = "default"
TENANT = web.RequestKey("tenant", str)  # set on requests the middleware let through


def split_name(entry: str) -> tuple[str, str]:
    """(tenant name, key) of a configured entry: `name:key`, or a bare key (`default`).

    A bare key that itself holds a colon must be written with a name in front.
    """
    name, sep, key = entry.partition(":")
    if sep and _NAME.fullmatch(name):
        return name, key
    return DEFAULT_TENANT, entry


class ApiKeys:
    """A set of accepted bearer tokens, each with the tenant name it is counted under."""

    __slots__ = ("_keys", "_names")

    def __init__(self, keys: Iterable[str]) -> None:
        cleaned = [split_name(k.strip()) for k in keys if k.strip()]
        cleaned = [(n, k.strip()) for n, k in cleaned]
        if not cleaned or not all(k for _, k in cleaned):
            raise ConfigError("API keys were configured, but none is non-empty")
        for _, key in cleaned:
            if any(c.isspace() for c in key) or not key.isprintable():
                raise ConfigError("an API key contains whitespace or control characters")
        self._keys = tuple(k.encode() for _, k in cleaned)
        self._names = tuple(n for n, _ in cleaned)

    def names(self) -> list[str]:
        """The tenant names the keys carry, each once."""
        return sorted(set(self._names))

    @classmethod
    def load(cls, keys: Iterable[str] = (), path: str | None = None) -> ApiKeys | None:
        """From a list and/or a file (a key a line, `name:key` to name its tenant, `#` comments);
        None when neither is given.

        A bad key in the file is reported with its file and line; the key itself never is.
        """
        found = [k for k in keys if k.strip()]
        if path:
            try:
                lines = Path(path).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"cannot read API key file {path}: {exc.strerror}") from exc
            for number, line in enumerate(lines, 1):
                key = _COMMENT.sub("", line).strip()
                if not key:
                    continue
                try:
                    cls([key])
                except ConfigError as exc:
                    raise ConfigError(f"{path}:{number}: {exc}") from None
                found.append(key)
        if not found and not path:
            return None
        return cls(found)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"ApiKeys(<{len(self._keys)} redacted>)"

    def identify(self, presented: str) -> str | None:
        """The tenant name of the key `presented` equals, or None; every key is compared, so
        the time taken does not depend on which matched."""
        candidate = presented.encode("utf-8", "surrogateescape")
        found: str | None = None
        for key, name in zip(self._keys, self._names, strict=True):
            if hmac.compare_digest(candidate, key):
                found = name
        return found

    def identify_header(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer <key>` header value, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        return self.identify(token.strip()) if scheme.lower() == "bearer" else None


def auth_middleware(keys: ApiKeys) -> Middleware:
    """Answer 401 (OpenAI's shape) before the body is read, unless the request has a valid key."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization")
        tenant = keys.identify_header(header)
        if tenant is not None:
            request[TENANT] = tenant
            return await handler(request)
        message = (
            "Incorrect API key provided."
            if header
            else "You didn't provide an API key (Authorization: Bearer <key>)."
        )
        resp = OPENAI.error(401, message, code="invalid_api_key")
        resp.headers["WWW-Authenticate"] = 'Bearer realm="powerbatch"'
        return resp

    return middleware
