"""The browser client every node serves at ``/``: static files shipped with this package, copied into the
node bundle under ``web/`` and served by nginx (``infra.node.bundle.nginx``).

Plain ES modules, no build step, nothing fetched from elsewhere (the page's Content-Security-Policy allows
only the node itself): ``index.html``, ``style.css``, ``app.js`` (the page), ``protocol.js`` (the wire
protocol, the admission check and the refusal reasons in plain words), ``audio-worklet.js`` (microphone
capture resampled to 24 kHz Int16 frames), ``player.js`` (playback through an AudioContext),
``playout.js`` (the adaptive playout buffer's logic, docs/node.md), ``rtc.js`` (the WebRTC transport:
``/api/rtc`` signalling, ICE, getStats), ``favicon.svg``.

Where nginx finds them: ``web/`` under its prefix (the node directory) on a ``processes`` node; on a
``compose`` node the bundle's ``web/`` is mounted read-only at ``WEB_CONTAINER_ROOT`` in the nginx
container. On a GCE VM the files travel in the cloud-init user-data with the rest of the bundle.
"""

from __future__ import annotations

import importlib.resources

from infra.node.profile.profiles import NodeProfile

__all__ = [
    "WEB_CONTAINER_ROOT",
    "WEB_DIR",
    "WEB_TYPES",
    "content_security_policy",
    "page_headers",
    "render_web",
    "web_root",
]

WEB_DIR = "web"
"""The bundle directory holding the client's files."""

WEB_CONTAINER_ROOT = "/usr/share/duplex/web"
"""Where the nginx container of a ``compose`` node sees ``WEB_DIR`` (a read-only bind mount)."""

WEB_TYPES: dict[str, str] = {
    "html": "text/html",
    "css": "text/css",
    "js": "text/javascript",
    "svg": "image/svg+xml",
}
"""File extension -> MIME type: the only files shipped and the only types nginx serves from ``/``. ES modules
and worklets are refused by browsers unless they come as JavaScript."""

_PACKAGE, _SOURCE_DIR = "infra.node", "web"


def render_web() -> dict[str, bytes]:
    """``{"web/<name>": content}`` for every client file shipped in the package (``infra/node/web/``), by
    name; only the extensions of ``WEB_TYPES``. Always the same bytes for the same installed package.

    Raises:
        FileNotFoundError: the package was installed without its web files (a packaging bug), or
            ``index.html`` is missing.
    """
    source = importlib.resources.files(_PACKAGE).joinpath(_SOURCE_DIR)
    if not source.is_dir():
        raise FileNotFoundError(
            f"the browser client's files are missing from the installed package ({_PACKAGE}/{_SOURCE_DIR}/); "
            "reinstall duplexops (pyproject.toml's package-data ships them)"
        )
    files = {
        f"{WEB_DIR}/{entry.name}": entry.read_bytes()
        for entry in source.iterdir()
        if entry.is_file() and entry.name.rsplit(".", 1)[-1] in WEB_TYPES
    }
    if f"{WEB_DIR}/index.html" not in files:
        raise FileNotFoundError(f"{_PACKAGE}/{_SOURCE_DIR}/index.html is missing: the client has no page")
    return dict(sorted(files.items()))


def web_root(profile: NodeProfile) -> str:
    """nginx's ``root`` for the client: ``web`` (relative to nginx's prefix, the node directory) on a
    ``processes`` node, ``WEB_CONTAINER_ROOT`` in a container."""
    return WEB_DIR if profile.deployment == "processes" else WEB_CONTAINER_ROOT


def content_security_policy(page_origin: str) -> str:
    """The page's Content-Security-Policy for a page served at ``page_origin`` (``https://<host>[:port]``):
    scripts (and the AudioWorklet), styles, images and connections from the page's own origin only
    (``'self'``, and its ``wss://`` origin for the session, which older browsers do not count as
    ``'self'``); no plugins, no framing, no ``<base>``, no form posts."""
    wss_origin = "wss://" + page_origin.removeprefix("https://")
    return "; ".join(
        (
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "img-src 'self'",
            f"connect-src 'self' {wss_origin}",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )


def page_headers(page_origin: str) -> dict[str, str]:
    """The response headers every file of the page is served with, in order, wherever it is served (a
    node's nginx, the multi-region stack's page backend service): HSTS (2 years), the CSP of
    ``content_security_policy``, ``nosniff``, the microphone for the page itself only, no referrer, no
    framing, a separate browsing context group, and ``no-cache`` (revalidate: a node update shows at once)."""
    return {
        "Strict-Transport-Security": "max-age=63072000",
        "Content-Security-Policy": content_security_policy(page_origin),
        "X-Content-Type-Options": "nosniff",
        "Permissions-Policy": "microphone=(self), camera=(), geolocation=()",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        "Cross-Origin-Opener-Policy": "same-origin",
        "Cache-Control": "no-cache",
    }
