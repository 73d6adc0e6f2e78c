"""A bare aiohttp pass-through: a second hop on aiohttp's client and server (proxy_overhead.py).

Every request goes to the upstream unchanged and the answer comes back chunk by chunk, with none
of powerbatch's work (no admission, no body parse, no metrics, no control loop), so
`bare - direct` is what any aiohttp reverse proxy costs and `powerbatch - bare` is powerbatch's own.

    python benchmarks/bare_hop.py --upstream http://127.0.0.1:8101 --port 8102
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def create_app(upstream: str) -> web.Application:
    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        connector = aiohttp.TCPConnector(limit=0)
        app["session"] = aiohttp.ClientSession(
            upstream, connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        )
        yield
        await app["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with session.request(
            request.method, request.rel_url, headers=headers, data=await request.read()
        ) as up:
            resp = web.StreamResponse(
                status=up.status,
                headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP},
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8102)
    a = p.parse_args()
    web.run_app(create_app(a.upstream), host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
