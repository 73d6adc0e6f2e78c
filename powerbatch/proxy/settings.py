"""The proxy's own settings: where it listens, the upstream, limits on requests, timeouts, keys."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from powerbatch.errors import ConfigError
from powerbatch.settings import check_bounds, setting


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """Proxy: listeners, upstream, request limits, timeouts and keys"""

    upstream: str = setting(help="base URL of the OpenAI-compatible server, http(s)://host:port")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on", ge=1, le=65_535)
    admin_port: int | None = setting(
        None,
        "serve /metrics and /status* on this port only",
        ge=1,
        le=65_535,
        default_doc="unset: on --port, behind the keys",
    )
    admin_host: str = setting("127.0.0.1", "address of the admin listener")
    upstream_metrics: bool = setting(True, "scrape the upstream's vLLM metrics as extra signals")
    max_body_bytes: int = setting(4 * 1024 * 1024, "larger request bodies get 413", ge=1)
    default_max_tokens: int = setting(256, "KV estimate for requests without max_tokens", ge=1)
    max_tokens_limit: int = setting(131_072, "larger max_tokens get 400", ge=1)
    connect_timeout_s: float = setting(5.0, "longest wait to connect to the upstream, s", gt=0)
    headers_timeout_s: float = setting(
        600.0,
        "longest wait for the upstream's response headers (a non-streamed answer: all of it), s",
        gt=0,
    )
    read_timeout_s: float = setting(120.0, "longest upstream silence inside a response, s", gt=0)
    client_timeout_s: float = setting(
        60.0, "longest a client may take to send its body (408) or to take a stream chunk, s", gt=0
    )
    api_keys: tuple[str, ...] = setting(
        (), "client API keys (Bearer), comma-separated or a list; none: no auth", secret=True
    )
    api_keys_file: str | None = setting(None, "file of client API keys, one a line (# comments)")
    upstream_api_key: str | None = setting(
        None, "send this key upstream instead of the client's Authorization", secret=True
    )
    drain_grace_s: float = setting(30.0, "on SIGTERM, time given to in-flight requests, s", ge=0)
    tenants: tuple[str, ...] = setting(
        (),
        "tenant names counted on their own in the energy metrics; others count as `other`",
        default_doc="the names the API keys carry",
    )
    models: tuple[str, ...] = setting(
        (),
        "model names counted on their own in the energy metrics; others count as `other`",
        default_doc="the first max_models seen",
    )
    max_models: int = setting(8, "with no models set, how many model names are counted", ge=0)
    energy_header: bool = setting(
        False, "add x-powerbatch-energy-j (the request's joules) to non-streamed answers"
    )
    access_log: bool = setting(
        False, "log a line per answered request at INFO: class, tenant, tokens, joules, time"
    )
    pass_routes: tuple[str, ...] = setting(
        (),
        "POST routes under /v1 that powerbatch does not know, relayed without admission (paths; "
        "a * matches within one segment); in enforce mode any other such route gets 403, as it "
        "may generate",
        default_doc="none beyond vLLM's non-generating routes (docs/operations.md)",
    )

    def __post_init__(self) -> None:
        check_bounds(self)
        url = urlsplit(self.upstream)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(
                f"upstream must be an http(s) URL with a host, e.g. http://127.0.0.1:8001, "
                f"got {self.upstream!r}"
            )
        try:
            url.port  # noqa: B018 - parsing the port is the check
        except ValueError:
            raise ConfigError(f"upstream has a bad port: {self.upstream!r}") from None
        if self.admin_port is not None and self.admin_port == self.port:
            raise ConfigError(
                f"admin_port ({self.admin_port}) must differ from port: the admin endpoints "
                "get their own listener"
            )

    @property
    def upstream_url(self) -> str:
        return self.upstream.rstrip("/")

    @property
    def admin_on_main(self) -> bool:
        return self.admin_port is None

    @property
    def metrics_url(self) -> str:
        return self.upstream_url + "/metrics"
