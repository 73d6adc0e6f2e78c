"""Access: client keys, the upstream's key, admin endpoints, and no open relay."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from conftest import run
from faults import chat_body, running_proxy, upstream

from powerbatch.cli.settings import SERVE
from powerbatch.errors import ConfigError
from powerbatch.proxy.auth import TENANT, ApiKeys, auth_middleware
from powerbatch.settings import load

KEY = "sk-client-0123456789abcdef"
OTHER = "sk-client-other"
UP_KEY = "sk-upstream-secret-42"
CHAT = "/v1/chat/completions"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admits(keys: ApiKeys, authorization: str | None) -> str | None:
    """The tenant the auth middleware lets a chat request through as, or None if it answers 401."""
    headers = {"Authorization": authorization} if authorization is not None else {}
    request = make_mocked_request("POST", CHAT, headers=headers)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(text=request[TENANT])

    resp = asyncio.run(auth_middleware(keys)(request, handler))
    assert resp.status in (200, 401)
    return resp.text if resp.status == 200 and isinstance(resp, web.Response) else None


def test_requests_without_a_valid_key_get_401_and_never_reach_upstream() -> None:
    async def go() -> None:
        async with (
            upstream() as up,
            running_proxy(up.url, api_keys=(KEY, OTHER), max_body_bytes=1024) as p,
            aiohttp.ClientSession() as s,
        ):
            denied: list[dict[str, str]] = [
                {},
                bearer("sk-wrong"),
                bearer(KEY[:-1]),
                bearer(KEY + "x"),
                {"Authorization": KEY},
                {"Authorization": f"Basic {KEY}"},
                {"Authorization": "Bearer "},
                {"X-Api-Key": KEY},
            ]
            for headers in denied:
                for method, path in (
                    ("POST", CHAT),
                    ("POST", "/v1/completions"),
                    ("GET", "/v1/models"),
                    ("GET", "/status"),
                    ("GET", "/status/history"),
                    ("GET", "/metrics"),
                    ("GET", "/no-such-route"),
                ):
                    # A huge body: 401 comes first, so the body is never read (no 413).
                    data = json.dumps(chat_body("x" * 4096)).encode()
                    async with s.request(method, p.url + path, data=data, headers=headers) as r:
                        assert r.status == 401, (headers, path)
                        assert r.headers["WWW-Authenticate"].startswith("Bearer")
                        err = (await r.json())["error"]
                        assert err["code"] == "invalid_api_key"
                        assert err["type"] == "authentication_error"
            assert up.seen == []
            for path in ("/health", "/ready"):  # probes stay open
                async with s.get(p.url + path) as r:
                    assert r.status == 200
            for key in (KEY, OTHER):
                async with s.post(p.url + CHAT, json=chat_body(), headers=bearer(key)) as r:
                    assert r.status == 200
                lower = {"authorization": f"bearer {key}"}  # header and scheme are case-blind
                async with s.get(p.url + "/status", headers=lower) as r:
                    assert r.status == 200
            assert len(up.seen) == 2

    run(go())


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = ApiKeys(["k1-aaaa", "k2-bbbb", "k3-cccc"])
    assert admits(keys, "Bearer k1-aaaa") == "default" and admits(keys, "Bearer k9") is None
    assert len(calls) == 6  # no early exit on a match: all three keys every time
    assert admits(keys, "bearer  k2-bbbb ") == "default" and admits(keys, None) is None
    assert admits(keys, "Basic k2-bbbb") is None and len(calls) == 9


def test_keys_from_a_file_through_the_serve_options(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# clients\n{KEY}\n\n  {OTHER}  \n")
    settings = load(
        SERVE,
        environ={
            "POWERBATCH_UPSTREAM": "http://127.0.0.1:9",
            "POWERBATCH_CEILING_W": "500",
            "POWERBATCH_API_KEYS_FILE": str(path),
            "POWERBATCH_API_KEYS": "sk-from-env",
            "POWERBATCH_UPSTREAM_API_KEY": UP_KEY,
        },
    ).proxy
    keys = ApiKeys.load(settings.api_keys, settings.api_keys_file)
    assert keys is not None and len(keys) == 3
    assert admits(keys, f"Bearer {OTHER}") and admits(keys, "Bearer sk-from-env")
    assert settings.upstream_api_key == UP_KEY
    for text in (repr(settings), repr(keys), str(settings)):
        assert KEY not in text and UP_KEY not in text and "sk-from-env" not in text
    with pytest.raises(ConfigError):
        ApiKeys.load(path=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError):
        ApiKeys.load(path=str(tmp_path / "empty"))


@pytest.mark.parametrize(
    ("client_keys", "upstream_key", "sent", "expected"),
    [
        (None, None, "Bearer sk-users-own-upstream-key", "Bearer sk-users-own-upstream-key"),
        (None, UP_KEY, "Bearer sk-users-own-upstream-key", f"Bearer {UP_KEY}"),
        ([KEY], UP_KEY, f"Bearer {KEY}", f"Bearer {UP_KEY}"),
        ([KEY], None, f"Bearer {KEY}", None),  # the proxy's key is not passed on
    ],
)
def test_upstream_authorization_is_forwarded_or_replaced(
    client_keys: list[str] | None, upstream_key: str | None, sent: str, expected: str | None
) -> None:
    async def go() -> None:
        keys = tuple(client_keys or ())
        async with (
            upstream() as up,
            running_proxy(up.url, api_keys=keys, upstream_api_key=upstream_key) as p,
            aiohttp.ClientSession() as s,
        ):
            headers = {"Authorization": sent}
            async with s.post(p.url + CHAT, json=chat_body(stream=True), headers=headers) as r:
                assert r.status == 200
            async with s.get(p.url + "/v1/models", headers=headers) as r:
                assert r.status == 200
            for seen in up.seen:
                auth = [v for k, v in seen.headers.items() if k.lower() == "authorization"]
                assert auth == ([expected] if expected else [])

    run(go())


def test_keys_are_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with upstream() as up:
            async with (
                running_proxy(up.url, api_keys=(KEY,), upstream_api_key=UP_KEY) as p,
                aiohttp.ClientSession() as s,
            ):
                for key in (KEY, "sk-wrong-guess"):
                    async with s.post(p.url + CHAT, json=chat_body(), headers=bearer(key)) as r:
                        await r.read()
                await up.stop()  # errors get logged: they must not carry keys either
                async with s.post(p.url + CHAT, json=chat_body(), headers=bearer(KEY)) as r:
                    assert r.status == 503
                async with s.get(p.url + "/status", headers=bearer(KEY)) as r:
                    status = await r.text()
            assert KEY not in status and UP_KEY not in status

    with caplog.at_level(logging.DEBUG):
        run(go())
    text = "\n".join(r.getMessage() for r in caplog.records)
    for secret in (KEY, UP_KEY, "sk-wrong-guess"):
        assert secret not in text


def test_admin_endpoints_can_live_on_their_own_port() -> None:
    async def go() -> None:
        async with (
            upstream() as up,
            running_proxy(up.url, api_keys=(KEY,), admin_port=True) as p,
            aiohttp.ClientSession() as s,
        ):
            assert p.admin_url is not None
            for path in ("/status", "/status/history", "/metrics"):
                async with s.get(p.url + path, headers=bearer(KEY)) as r:
                    assert r.status == 404  # not on the client port, even with a key
                async with s.get(p.admin_url + path) as r:
                    assert r.status == 200
            async with s.get(p.admin_url + CHAT) as r:
                assert r.status == 404  # and the admin port relays nothing
            async with s.post(p.admin_url + CHAT, json=chat_body()) as r:
                assert r.status == 404
            assert up.seen == []

    run(go())


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        async with asyncio.timeout(3):
            return await reader.read(65536)
    finally:
        writer.close()


def test_no_open_relay() -> None:
    """Absolute-URI targets, Host headers, CONNECT and odd paths never reach another server."""

    async def go() -> None:
        async with upstream() as up, upstream() as elsewhere, running_proxy(up.url) as p:
            port = int(p.url.rsplit(":", 1)[1])
            other = f"127.0.0.1:{elsewhere.port}".encode()
            body = json.dumps(chat_body()).encode()
            post_tail = b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
                len(body),
                body,
            )
            attempts: list[bytes] = [
                b"GET http://%s/v1/models HTTP/1.1\r\nHost: %s\r\n\r\n" % (other, other),
                b"POST http://%s/v1/chat/completions HTTP/1.1\r\nHost: %s\r\n" % (other, other)
                + post_tail,
                b"GET /v1/models HTTP/1.1\r\nHost: %s\r\n\r\n" % other,
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Forwarded-Host: %s\r\n\r\n" % other,
                b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (other, other),
                b"GET //%s/v1/models HTTP/1.1\r\nHost: x\r\n\r\n" % other,
                b"GET /v1/@%s/models HTTP/1.1\r\nHost: x\r\n\r\n" % other,
                b"GET /v1/../../%s/v1/models HTTP/1.1\r\nHost: x\r\n\r\n" % other,
            ]
            answers: list[Any] = []
            for attempt in attempts:
                answers.append(await _raw(port, attempt))
            assert elsewhere.seen == [], [s.path for s in elsewhere.seen]
            for seen in up.seen:  # what did arrive went to the configured upstream only
                host = next(v for k, v in seen.headers.items() if k.lower() == "host")
                assert host == f"127.0.0.1:{up.port}"
            assert all(a.startswith(b"HTTP/1.") for a in answers)

    run(go())
