"""nginx in front of the runtime: TLS termination, the WebSocket proxy and the node's session cap.

``render_nginx(profile)`` gives ``nginx/nginx.conf``: TLS 1.2/1.3 only, plain HTTP redirected except the
ACME HTTP-01 webroot (``infra.node.bundle.acme``), ``/api/chat`` proxied as a WebSocket with ``limit_conn``
per node and per client address (503) and ``limit_req`` on handshakes (429), WebRTC signalling (``/api/rtc``:
POST of an offer under the same limits, the ICE servers, DELETE of a session), the sessions API
(``/api/sessions``, GET and DELETE), ``/metrics`` and ``/slotz`` 404 on the public side, the browser client
(``infra.node.bundle.webclient``) at ``/`` under a CSP that allows only the node itself, no session token in
the access log. The same profile always gives the same bytes.

What each directive does, and why: docs/node.md, "The bundle"."""

from __future__ import annotations

import posixpath

from infra.node.bundle.acme import ACME_CHALLENGE_PREFIX, nginx_webroot
from infra.node.bundle.services import endpoint, public_origin
from infra.node.bundle.webclient import WEB_TYPES, page_headers, web_root
from infra.node.bundle.webclient import content_security_policy as page_csp
from infra.node.profile.profiles import NodeProfile

__all__ = [
    "NGINX_CONF",
    "RTC_OFFER_MAX_BYTES",
    "SESSION_TIMEOUT_MARGIN_S",
    "content_security_policy",
    "render_nginx",
]

NGINX_CONF = "nginx/nginx.conf"
"""The bundle path of the rendered configuration."""

SESSION_TIMEOUT_MARGIN_S = 60
"""How much longer than ``limits.max_session_s`` nginx keeps a WebSocket open (s): the runtime closes a
session at its limit; nginx must never be the one that cuts it."""

# Mozilla "intermediate" TLS configuration (ssl-config.mozilla.org, version 5.7): TLS 1.2 ciphers with
# forward secrecy and AEAD only; TLS 1.3 suites are not configurable here and all are strong.
_TLS12_CIPHERS = ":".join(
    (
        "ECDHE-ECDSA-AES128-GCM-SHA256",
        "ECDHE-RSA-AES128-GCM-SHA256",
        "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-RSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-CHACHA20-POLY1305",
        "ECDHE-RSA-CHACHA20-POLY1305",
    )
)


RTC_OFFER_MAX_BYTES = 32_768
"""nginx's body cap on ``POST /api/rtc`` (bytes): the runtime's ``rtc.MAX_OFFER_BYTES`` (its own 413), so an
oversized offer stops at the edge (the node bundle does not import the runtime; a test checks they match)."""

# The /api/rtc locations' proxying: a level that sets proxy_set_header inherits none from the server level.
_RTC_PROXY = "\n".join(
    "            " + line
    for line in (
        "proxy_pass http://duplex_runtime;",
        "proxy_http_version 1.1;",
        "proxy_set_header Host $host;",
        "proxy_set_header X-Real-IP $remote_addr;",
        "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "proxy_set_header X-Forwarded-Proto https;",
        'proxy_set_header Connection "";',
        "proxy_connect_timeout 5s;",
    )
)


def content_security_policy(profile: NodeProfile) -> str:
    """The browser client's Content-Security-Policy on this node (``webclient.content_security_policy`` for
    the node's public origin)."""
    return page_csp(public_origin(profile))


def _page_header_lines(profile: NodeProfile) -> str:
    """``add_header`` lines of ``webclient.page_headers`` (values quoted where nginx needs it)."""
    lines = []
    for name, value in page_headers(public_origin(profile)).items():
        shown = value if value.replace("-", "").isalnum() else f'"{value}"'
        lines.append(f"            add_header {name} {shown} always;")
    return "\n".join(lines)


SESSION_PATHS = (
    "/api/chat",
    "/api/carriers/twilio",
    "/api/carriers/plivo",
    "/api/carriers/telnyx",
    "/api/carriers/exotel",
)
"""The routes that upgrade to a session: Kyutai's WebSocket (runtime.frontend.http CHAT_PATH) and the phone
carriers' bridges (runtime.frontend.transports.carriers: twilio TWILIO_PATH, plivo PLIVO_PATH, telnyx
TELNYX_PATH, exotel EXOTEL_PATH)."""

_SESSION_LOCATION = """        location = {path} {{
            limit_conn duplex_node_sessions {sessions};
{per_client_line}            limit_req zone=duplex_handshakes burst={burst} nodelay;
            error_page 503 @node_full;
            error_page 429 @too_many_handshakes;
            error_page 502 504 @runtime_unavailable;  # error_page is not inherited once a level sets one

            proxy_pass http://duplex_runtime;
            proxy_http_version 1.1;
            # A level that sets proxy_set_header inherits none from the server level: all of them again.
            proxy_set_header Host $host;
            proxy_set_header X-Real-IP $remote_addr;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto https;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_buffering off;
            proxy_connect_timeout 5s;
            # Longer than the longest session ({max_session_s} s): the runtime ends sessions.
            proxy_read_timeout {timeout_s}s;
            proxy_send_timeout {timeout_s}s;
        }}

"""
"""One session route's location (``str.format``: path, sessions, per_client_line, burst, max_session_s,
timeout_s)."""
_CARRIER_PREFIX = "/api/carriers/"
"""A carrier's media servers connect from a few addresses, many calls each: no per-client-address cap there
(the signature is their gate; the node's cap and the handshake rate still apply)."""


def render_nginx(profile: NodeProfile) -> dict[str, bytes]:
    """``{"nginx/nginx.conf": ...}`` for ``profile``; the same profile always gives the same bytes."""
    local = profile.deployment == "processes"
    paths = (
        {"pid": "run/nginx.pid", "logs": "logs", "temp": "run"}
        if local
        else {"pid": "/var/run/nginx.pid", "logs": "/var/log/nginx", "temp": "/var/cache/nginx"}
    )
    # nginx resolves certificate paths against the configuration file's directory (logs and pid against
    # its -p prefix, the node directory): a relative TLS path of the profile is relative to the node dir.
    certificate, private_key = (
        path if path.startswith("/") else posixpath.relpath(path, posixpath.dirname(NGINX_CONF))
        for path in (profile.tls.certificate_path, profile.tls.private_key_path)
    )
    timeout_s = profile.limits.max_session_s + SESSION_TIMEOUT_MARGIN_S
    # In a container nginx binds every interface of its own network namespace; Compose publishes the
    # ports on the profile's public address.
    public = profile.public_address if local else "0.0.0.0"
    https_port = profile.ports.https
    redirect_port = "" if https_port == 443 else f":{https_port}"
    limits = profile.limits
    rate = limits.handshakes_per_second_per_client
    too_many = (
        f"too many connection attempts from your address: at most {rate:g} "
        f"per second (burst {limits.handshake_burst}); retry later\\n"
    )
    node_full = (
        f"node full: this node serves at most {profile.sessions} sessions, "
        f"{profile.limits.max_sessions_per_client} per client address; retry later or use another node\\n"
    )
    types = " ".join(f"{mime} {ext};" for ext, mime in sorted(WEB_TYPES.items()))
    temp_dirs = "\n".join(
        f"    {kind}_temp_path {paths['temp']}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # One location per route that upgrades to a session (Kyutai's WebSocket, a phone carrier's media
    # stream): each holds a node and a client connection slot for its life.
    session_locations = "".join(
        _SESSION_LOCATION.format(
            path=path,
            sessions=profile.sessions,
            per_client_line=""
            if path.startswith(_CARRIER_PREFIX)
            else f"            limit_conn duplex_client_sessions {profile.limits.max_sessions_per_client};\n",
            burst=limits.handshake_burst,
            max_session_s=profile.limits.max_session_s,
            timeout_s=timeout_s,
        )
        for path in SESSION_PATHS
    )
    conf = f"""# Rendered by infra.node.bundle.nginx for profile {profile.name!r}. Do not edit: re-render.
worker_processes {1 if local else "auto"};
pid {paths["pid"]};
error_log {paths["logs"]}/error.log warn;

# On shutdown, open WebSockets get the drain grace, then are closed (the runtime drains the same way).
worker_shutdown_timeout {profile.limits.drain_grace_s + 5}s;

events {{
    worker_connections 4096;
}}

http {{
    server_tokens off;
    default_type application/octet-stream;
    # "$request_method $uri", not "$request": no query string (a session token may be in it) in the log.
    log_format duplex '$remote_addr [$time_iso8601] "$request_method $uri" $status $body_bytes_sent '
                      'rt=$request_time upstream=$upstream_status conn=$connection';
    access_log {paths["logs"]}/access.log duplex;
{temp_dirs}

    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ''      close;
    }}

    # Session caps: an upgraded WebSocket holds its limit_conn slot for its whole life.
    limit_conn_zone $server_name zone=duplex_node_sessions:1m;
    limit_conn_zone $binary_remote_addr zone=duplex_client_sessions:10m;
    limit_conn_status 503;
    limit_conn_log_level warn;

    # Handshake rate per client address: floods of connection attempts stop here with 429.
    limit_req_zone $binary_remote_addr zone=duplex_handshakes:10m rate={limits.nginx_handshake_rate};
    limit_req_status 429;
    limit_req_log_level warn;

    upstream duplex_runtime {{
        server {endpoint(profile, "runtime")} max_fails=0;
        keepalive 8;
    }}

    server {{
        listen {public}:{profile.ports.http};
        server_name {profile.domain};
        # ACME HTTP-01 tokens (infra.node.bundle.acme): plain HTTP, files only, no redirect.
        location ^~ {ACME_CHALLENGE_PREFIX} {{
            root {nginx_webroot(profile)};
            default_type text/plain;
            try_files $uri =404;
            limit_except GET {{
                deny all;
            }}
        }}
        location / {{
            return 301 https://$host{redirect_port}$request_uri;
        }}
    }}

    server {{
        listen {public}:{https_port} ssl;
        server_name {profile.domain};

        ssl_certificate {certificate};
        ssl_certificate_key {private_key};
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_ciphers {_TLS12_CIPHERS};
        ssl_prefer_server_ciphers off;
        ssl_session_cache shared:duplex_tls:10m;
        ssl_session_timeout 1d;
        ssl_session_tickets off;
        add_header Strict-Transport-Security "max-age=63072000" always;

        proxy_set_header Host $host;
        proxy_set_header X-Real-IP $remote_addr;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_set_header X-Forwarded-Proto https;

        error_page 502 504 @runtime_unavailable;

{session_locations}        location = /healthz {{
            proxy_pass http://duplex_runtime;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}

        location = /readyz {{
            proxy_pass http://duplex_runtime;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}

        # The browser client's admission check (why a session would be refused: a browser cannot read a
        # refused upgrade's status) and the node's voices. The check verifies tokens: rate-limited as
        # handshakes are.
        location = /api/admission {{
            limit_req zone=duplex_handshakes burst={limits.handshake_burst} nodelay;
            error_page 429 @too_many_handshakes;
            error_page 502 504 @runtime_unavailable;
            proxy_pass http://duplex_runtime;
            proxy_http_version 1.1;
            proxy_set_header Host $host;
            proxy_set_header X-Real-IP $remote_addr;
            proxy_set_header Connection "";
        }}

        location = /api/personas {{
            proxy_pass http://duplex_runtime;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}

        # The sessions API (runtime/frontend/sessions_api.py): application backends with an application
        # token (Authorization: Bearer, passed through). GET and DELETE only; recordings stream unbuffered.
        # nginx normalises the path first: "/api/sessions/../x" never reaches this location.
        location ^~ /api/sessions {{
            limit_except GET DELETE {{
                deny all;
            }}
            error_page 502 504 @runtime_unavailable;
            proxy_pass http://duplex_runtime;
            proxy_http_version 1.1;
            proxy_set_header Host $host;
            proxy_set_header X-Real-IP $remote_addr;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto https;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}

        # WebRTC signalling (runtime/frontend/transports/webrtc/signalling.py; docs/protocol.md, "WebRTC"):
        # one POST of the SDP offer
        # per session, capped at the runtime's limit (its own 413, the same sentence), rate-limited as
        # handshakes are. The media never passes here: UDP through the node's TURN relay (coturn). The
        # connection caps hold only while the POST is open (a waiting room's wait included): the runtime caps
        # the sessions.
        location = /api/rtc {{
            limit_except POST {{
                deny all;
            }}
            client_max_body_size {RTC_OFFER_MAX_BYTES};
            client_body_buffer_size {RTC_OFFER_MAX_BYTES};
            limit_conn duplex_node_sessions {profile.sessions};
            limit_conn duplex_client_sessions {profile.limits.max_sessions_per_client};
            limit_req zone=duplex_handshakes burst={limits.handshake_burst} nodelay;
            error_page 503 @node_full;
            error_page 429 @too_many_handshakes;
            error_page 413 @offer_too_large;
            error_page 502 504 @runtime_unavailable;
{_RTC_PROXY}
            # A waiting room holds the POST until a slot frees: as long as a WebSocket may stay open.
            proxy_read_timeout {timeout_s}s;
        }}

        # TURN credentials before the offer (the token is checked, not spent): rate-limited the same way.
        location = /api/rtc/ice-servers {{
            limit_except GET {{
                deny all;
            }}
            limit_req zone=duplex_handshakes burst={limits.handshake_burst} nodelay;
            error_page 429 @too_many_handshakes;
            error_page 502 504 @runtime_unavailable;
{_RTC_PROXY}
        }}

        # DELETE of the Location a 201 gave (/api/rtc/<session>/<key>) ends the session.
        location ^~ /api/rtc/ {{
            limit_except DELETE {{
                deny all;
            }}
            error_page 502 504 @runtime_unavailable;
{_RTC_PROXY}
        }}

        # Never public: Prometheus scrapes the runtime on the private address.
        location = /metrics {{
            return 404;
        }}

        # Never public: whether the node has a free slot is the load balancer's business (issue 33).
        location = /slotz {{
            return 404;
        }}

        location @node_full {{
            default_type text/plain;
            return 503 "{node_full}";
        }}

        location @too_many_handshakes {{
            default_type text/plain;
            return 429 "{too_many}";
        }}

        location @offer_too_large {{
            default_type text/plain;
            return 413 "the SDP offer is over {RTC_OFFER_MAX_BYTES} bytes\\n";
        }}

        location @runtime_unavailable {{
            default_type text/plain;
            return 502 "runtime unavailable: the node's runtime is down or not answering\\n";
        }}

        # The browser client (infra.node.bundle.webclient): static files only.
        location / {{
            root {web_root(profile)};
            index index.html;
            try_files $uri $uri/ =404;
            limit_except GET {{
                deny all;
            }}
            types {{ {types} }}
            default_type application/octet-stream;
            charset utf-8;
            charset_types text/css text/javascript image/svg+xml;
            error_page 404 @not_found;
            # A level with add_header inherits none from the server level: HSTS again.
{_page_header_lines(profile)}
        }}

        location @not_found {{
            default_type text/plain;
            add_header Strict-Transport-Security "max-age=63072000" always;
            add_header X-Content-Type-Options nosniff always;
            return 404 "not found: the browser client is at /, WebSocket sessions at /api/chat\\n";
        }}
    }}
}}
"""
    return {NGINX_CONF: conf.encode()}
