"""Service URLs: validated before any request, and written without credentials anywhere they are kept."""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit, urlunsplit

from gpumigrate.errors import InvalidInputError


def _split(url: str) -> SplitResult | None:
    try:
        return urlsplit(url)
    except ValueError:  # an unbalanced IPv6 bracket, a host that is no address
        return None


def redact_url(url: str) -> str:
    """Drop user:password@, query and fragment from a URL before it reaches reports or logs."""
    parts = _split(url)
    if parts is None:
        return "(a URL that does not parse)"
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    try:
        port = parts.port
    except ValueError:  # an out-of-range port: keep the URL recognisable, never its credentials
        port = None
    if port:
        netloc += f":{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def check_url(url: str, side: str) -> str:
    """An http(s) URL with a host (and a valid port); InvalidInputError (exit 2) otherwise."""
    parts = _split(url)
    try:
        parts.port if parts else None  # noqa: B018 (raises for a port outside 0-65535)
        valid_port = True
    except ValueError:
        valid_port = False
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not valid_port:
        raise InvalidInputError(
            f"{side} URL {redact_url(url)!r} is not valid: use http(s)://host:port, e.g. http://127.0.0.1:8000"
        )
    return url.rstrip("/")
