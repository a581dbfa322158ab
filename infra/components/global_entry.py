"""``GlobalEntry``: one global external Application Load Balancer in front of every region's runtime pods,
built from the standalone NEGs GKE makes from the runtime Service, with Cloud Armor, a managed certificate
and the browser client from each cluster's page pods (``infra.k8s.page``). docs/deploying.md, "Stack
multi-region".
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_gcp.compute as compute

from infra.components._util import COMPONENT_PACKAGE, child_options, dependencies
from infra.k8s.workload import GOOGLE_FRONT_END_RANGES
from runtime.region_routes import ROUTE_PREFIX

__all__ = [
    "BACKEND_TIMEOUT_MARGIN_S",
    "GOOGLE_FRONT_END_RANGES",
    "MAX_BACKEND_TIMEOUT_S",
    "MAX_CONNECTION_DRAINING_S",
    "MAX_SLOT_UTILIZATION",
    "PAGE_REQUESTS_PER_ENDPOINT_S",
    "RUNTIME_PATHS",
    "RUNTIME_RETRY_POLICY",
    "SLOT_UTILIZATION_METRIC",
    "SSL_POLICY",
    "GlobalEntry",
    "certificate_name",
    "GlobalEntryArgs",
    "RegionBackend",
    "neg_url",
    "regional_path",
    "security_rules",
]

BACKEND_TIMEOUT_MARGIN_S = 60
"""Seconds the backend timeout adds to the longest session (the runtime closes a session at its limit)."""

MAX_BACKEND_TIMEOUT_S = 2_147_483_647
"""The longest backend timeout the API takes (pulumi-gcp 10.2 ``BackendService.timeout_sec``: "1 through
2,147,483,647 seconds"). For a WebSocket behind the global external Application Load Balancer it is the
longest the connection may live, so it is the longest session plus ``BACKEND_TIMEOUT_MARGIN_S``."""

MAX_CONNECTION_DRAINING_S = 3600
"""The longest connection-draining timeout a backend service takes (1 h)."""

RUNTIME_PATHS = (
    "/api/chat",
    "/api/admission",
    "/api/personas",
    "/api/rtc",
    "/api/rtc/*",
    "/api/sessions",
    "/api/sessions/*",
    "/api/carriers/twilio",
    "/api/carriers/plivo",
    "/api/carriers/telnyx",
    "/api/carriers/exotel",
)
"""The runtime's public paths the global entry routes to the pods (a URL map path rule's trailing ``/*`` is
a prefix match); every other path is the browser client's. WebRTC signalling (``/api/rtc``: the offer, the
ICE servers, ``DELETE`` of a session) passes here, and so does a phone carrier's media stream (a WebSocket
like ``/api/chat``); WebRTC's media goes through the region's TURN gateway
(``infra.k8s.turn``). A ``DELETE /api/rtc/<session>/<key>`` or a sessions API call is balanced per request:
it may reach another pod than the session's (then 404); the session still ends when its peer closes."""

PAGE_REQUESTS_PER_ENDPOINT_S = 100
"""Requests per second the load balancer sends one page pod (``RATE`` balancing) before it spills to the
next zone or region: a page load is seven small files, served by nginx from memory."""

ARMOR_RULES_PER_MATCH = 10
"""Cloud Armor's limit of source ranges in one basic match rule."""

SSL_POLICY = {"profile": "RESTRICTED", "min_tls_version": "TLS_1_2"}
"""The HTTPS proxy's SSL policy: TLS 1.2 or later with the ``RESTRICTED`` profile's AEAD-only suites
(cloud.google.com/load-balancing/docs/ssl-policies-concepts). Without a policy the proxy uses Google's
default, ``COMPATIBLE`` from TLS 1.0. Every browser that runs the client (AudioWorklet, ES modules) speaks
TLS 1.2 with AES-GCM or ChaCha20."""


RESUME_ROUTER_REQUESTS_PER_ENDPOINT_S = 100
"""Requests per second the load balancer sends one resume-router pod (``RATE`` balancing): resumes and
WebRTC offers only, each one request; nginx proxies thousands."""


def regional_path(region: str) -> str:
    """The URL map's path of ``region``'s routes: ``/r/<region>/*`` (a prefix match) to its resume router
    (``infra.k8s.resume_router``): resumes naming a pod, and WebRTC offers kept in the region of their ICE
    servers (``runtime.region_routes``)."""
    return f"{ROUTE_PREFIX}{region}/*"


CERTIFICATE_HASH_CHARS = 8
"""Hex characters of the domain's SHA-256 in the certificate's name (32 bits: two domains of one stack
colliding is not a concern)."""


def certificate_name(name_prefix: str, domain: str) -> str:
    """The managed certificate's GCP name for ``domain``: ``<name_prefix>-entry-<8 hex of sha256(domain)>``.

    A ``ManagedSslCertificate``'s domains cannot be changed in place: the Compute API's ``sslCertificates``
    has insert, get, list and delete, no update or patch (cloud.google.com/compute/docs/reference/rest/v1/
    sslCertificates), so pulumi-gcp replaces the certificate on any change, and the way to change a domain
    is a new certificate on the target proxy, then the old one deleted (``targetHttpsProxies.
    setSslCertificates``; cloud.google.com/load-balancing/docs/ssl-certificates/google-managed-certs). A
    fixed name made a new ``domain`` fail: Pulumi replaces
    create-before-delete, and the new certificate's name was the old one's (409 "already exists"). Named
    after the domain, the new certificate is created beside the old, the HTTPS proxy is switched to it, and
    the old one is deleted last.

    Raises:
        ValueError: ``domain`` is empty, or the name would pass GCP's 63 characters.
    """
    if not domain:
        raise ValueError("domain is empty: the managed certificate needs the DNS name it is issued for")
    digest = hashlib.sha256(domain.lower().encode()).hexdigest()[:CERTIFICATE_HASH_CHARS]
    name = f"{name_prefix}-entry-{digest}"
    if len(name) > 63:
        raise ValueError(f"certificate name {name!r} is over GCP's 63 characters: shorten namePrefix")
    return name


def neg_url(project: str, zone: str, neg_name: str) -> str:
    """The URL of the standalone NEG ``neg_name`` in ``zone``."""
    return f"projects/{project}/zones/{zone}/networkEndpointGroups/{neg_name}"


SLOT_UTILIZATION_METRIC = "slot_utilization"
"""The custom metric the runtime backend service balances on: each pod's ORCA ``endpoint-load-metrics``
``named_metrics.slot_utilization`` (``runtime.frontend.gate.slot_load.SLOT_UTILIZATION``: slots in use,
held resumes and WebRTC calls included, over the pod's slots, in ``[0, 1]``)."""
MAX_SLOT_UTILIZATION = 1.0
"""A pod reporting this utilisation has no free slot: the load balancer sends it no new caller while
another endpoint is below it (``backends[].customMetrics[].maxUtilization``: range ``[0.0, 1.0]``)."""
RUNTIME_RETRY_POLICY: compute.URLMapPathMatcherPathRuleRouteActionRetryPolicyArgsDict = {
    "retry_conditions": ["gateway-error", "connect-failure", "refused-stream"],
    "num_retries": 3,
}
"""The runtime route's ``retryPolicy``: a 503 answered before the upgrade (a full pod's ``node_full``,
``Retry-After: 5``; an offer a full pod refuses) or a refused connection is tried again, on the endpoint the
balancing picks then (the full pod reported ``slot_utilization=1``), up to 3 more times. ``gateway-error`` is
502/503/504 only (``5xx`` would retry a 500 too). No ``perTryTimeout``: unset, each try gets the backend
service's timeout (the longest session), and a WebSocket's try lasts as long as its session."""


@dataclass(frozen=True)
class RegionBackend:
    """One region's pods as seen by the load balancer.

    Attributes:
        region: GCP region; zones: the zones of its GPU pool (one NEG in each).
        neg_name: the NEG name of the runtime Service's annotation.
        page_neg_name: the NEG name of the page Service's annotation (same zones).
        resume_router_neg_name: the NEG name of the region's resume router Service (same zones), or None:
            no ``/r/<region>/*`` route.
        sessions_per_endpoint: slots of one pod (the pod reports its use of them itself:
            ``SLOT_UTILIZATION_METRIC``).
        serving: False: capacity 0 (drained).
        ready: resources that must exist first (the region's Service and Deployment: their NEGs).
    """

    region: str
    zones: Sequence[str]
    neg_name: str
    page_neg_name: str
    sessions_per_endpoint: int
    serving: bool = True
    ready: Sequence[pulumi.Resource] = ()
    resume_router_neg_name: str | None = None


@dataclass(frozen=True)
class GlobalEntryArgs:
    """The global entry's settings.

    Attributes:
        name_prefix: prefix of resource names; project: the GCP project; network: the stack's VPC.
        domain: the certificate's DNS name.
        runtime_port: the pods' serving port (NEG endpoints' port), for the firewall rule.
        page_port: the page pods' serving port; page_health_path: what the page's health check asks for.
        backends: every region's NEGs.
        max_session_s: the longest session (s); the backend timeout is this plus
            ``BACKEND_TIMEOUT_MARGIN_S`` (at most ``MAX_BACKEND_TIMEOUT_S``).
        drain_s: connection-draining timeout (s): how long a removed endpoint keeps its WebSockets (at
            most ``MAX_CONNECTION_DRAINING_S``: sessions longer than an hour are cut when their pod leaves).
        public_source_ranges: who may connect (``0.0.0.0/0``: everyone).
        handshakes_per_minute: new requests per client IP per minute before 429.
        page_headers: response headers of every page file, in order (added by the page's backend service).
        labels: labels of the address.
        protect: ``protect`` the static IP (the domain's A record points at it; a new one breaks DNS and
            the certificate until both follow).
        resume_router_port: the resume routers' serving port (``infra.k8s.resume_router.ROUTER_PORT``), for
            the firewall rule; resume_router_health_path: what their health check asks for.
    """

    name_prefix: str
    project: str
    network: pulumi.Input[str]
    domain: str
    runtime_port: int
    page_port: int
    page_health_path: str
    backends: Sequence[RegionBackend]
    max_session_s: int
    drain_s: int
    public_source_ranges: Sequence[str]
    handshakes_per_minute: int
    page_headers: Mapping[str, str]
    labels: Mapping[str, str] = field(default_factory=dict)
    protect: bool = False
    resume_router_port: int = 8081
    resume_router_health_path: str = "/healthz"


class GlobalEntry(pulumi.ComponentResource):
    """The global HTTPS load balancer, its certificate, Cloud Armor policy and health check.

    Built from the standalone zonal network endpoint groups (NEGs) that GKE's NEG controller creates from the
    runtime Service's ``cloud.google.com/neg`` annotation (one per zone, same name in every region), rather
    than from a multi-cluster Gateway: every setting the entry depends on (timeout, affinity, health check,
    Cloud Armor, per-endpoint capacity) is then a Google Cloud resource that Pulumi owns, previews and tests,
    with no fleet registration or config cluster to keep alive.

    What it declares:

    - a global static IPv4 address and a Google-managed certificate for ``domain`` (it provisions once the
      domain's A record points at the address), named after the domain (``certificate_name``) so that a new
      domain creates a new certificate before the old one is deleted;
    - a Cloud Armor policy (``security_rules``): callers outside ``public_source_ranges`` get 403, and each
      client IP is throttled to ``handshakes_per_minute`` new requests per minute (429 beyond; a session is
      one request: the WebSocket upgrade), with adaptive layer-7 DDoS protection;
    - a health check on every pod's ``/readyz`` (the serving port of the NEG endpoint): it means serving, so
      a loading or draining pod turns 503 and receives no new callers, while a full pod stays healthy (it
      does not leave the NEG and come back a health check after a slot frees: issue 33);
    - the backend service: ``EXTERNAL_MANAGED`` scheme, a timeout of the longest session plus a margin (the
      default 30 s would cut every WebSocket at 30 s), connection draining as long as the runtime's drain, one
      backend per (region, zone) NEG balanced on the pods' own slot utilisation (``CUSTOM_METRICS`` on
      ``SLOT_UTILIZATION_METRIC``, which every runtime answer reports in its ORCA ``endpoint-load-metrics``
      header, with ``maxUtilization`` ``MAX_SLOT_UTILIZATION``; pods picked by ``WEIGHTED_ROUND_ROBIN`` on
      the same metric): a WebRTC call counts as a WebSocket does (its slot, not its request), the load
      balancer sends a caller to the nearest region with a free slot and spills over to the next nearest
      when every pod there is full. No session affinity: a reconnect may land on any pod with a free slot
      (affinity would need a hashing locality policy, which ignores load: the policy pack's
      ``session-affinity-needs-hash-policy``);
    - the runtime's route retries a 503 answered before the upgrade (``RUNTIME_RETRY_POLICY``): a pod full
      as the caller reached it (the report it balanced on was a request old) sends it to another;
    - the browser client (issue "a browser client on every node"): a second backend service over every
      region's page NEGs (``infra.k8s.page``: nginx pods on the system pools, one per zone), ``RATE``
      balancing, with its own health check, adding the page's security headers
      (``infra.node.bundle.webclient.page_headers``: CSP, HSTS, nosniff, ...). Not a public bucket: a backend
      bucket
      needs ``allUsers`` read, which secure-by-default organizations (created since May 2024) refuse. Its
      timeout is the runtime's only because the policy pack's ``backend-timeout-fits-websockets`` applies to
      every HTTP backend service; a file is answered in milliseconds. The URL map sends only the runtime's
      public paths (``RUNTIME_PATHS``: ``/api/chat``, ``/api/admission``, ``/api/personas``, ``/api/rtc``,
      ``/api/sessions``) to the runtime pods and everything else to the page, so ``/metrics``,
      ``/healthz`` and ``/readyz`` are not reachable from the internet (the health checks reach the pods
      directly), and each region's ``/r/<region>/*`` (``regional_path``) to that region's resume router
      (``infra.k8s.resume_router``: resumes naming their pod, WebRTC offers kept in their ICE servers'
      region; its own backend service per region, ``RATE`` balancing, the same Cloud Armor policy);
    - the HTTPS proxy (SSL policy ``SSL_POLICY``: TLS 1.2 or later) and forwarding rule on 443, and a
      port-80 rule that redirects to HTTPS;
    - a firewall rule on the stack's VPC admitting Google's front ends and health checkers
      (``35.191.0.0/16``, ``130.211.0.0/22``) to the runtime and page ports of the pods, and nothing else.

    A region with ``serving: false`` keeps its backends with ``capacity_scaler`` 0: no new callers, running
    conversations go on (a region's drain: docs/deploying.md, "Stack multi-region").
    """

    address: compute.GlobalAddress
    backend_service: compute.BackendService
    certificate: compute.ManagedSslCertificate
    security_policy: compute.SecurityPolicy
    health_check: compute.HealthCheck
    ssl_policy: compute.SSLPolicy
    page: compute.BackendService
    resume_routers: dict[str, compute.BackendService]

    def __init__(self, name: str, args: GlobalEntryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PACKAGE}:GlobalEntry", name, None, opts)
        deps = dependencies(opts)
        prefix, project = args.name_prefix, args.project

        def child(*extra: pulumi.Resource) -> pulumi.ResourceOptions:
            return child_options(self, [*deps, *extra])

        compute.Firewall(
            f"{name}-allow-google-front-ends",
            name=f"{prefix}-allow-lb",
            project=project,
            network=args.network,
            direction="INGRESS",
            source_ranges=list(GOOGLE_FRONT_END_RANGES),
            allows=[{"protocol": "tcp", "ports": _pod_ports(args)}],
            description="Google front ends and health checks to the runtime and page pods (NEG endpoints)",
            opts=child(),
        )
        self.address = compute.GlobalAddress(
            f"{name}-address",
            name=f"{prefix}-entry",
            project=project,
            ip_version="IPV4",
            labels=dict(args.labels),
            opts=child_options(self, deps, protect=args.protect),
        )
        # Named after the domain, replaced create-before-delete: a new domain gets a new certificate, the
        # HTTPS proxy moves to it, then the old one goes (``certificate_name``).
        self.certificate = compute.ManagedSslCertificate(
            f"{name}-certificate",
            name=certificate_name(prefix, args.domain),
            project=project,
            managed={"domains": [args.domain]},
            opts=child_options(self, deps, delete_before_replace=False),
        )
        self.security_policy = compute.SecurityPolicy(
            f"{name}-armor",
            name=f"{prefix}-entry",
            project=project,
            type="CLOUD_ARMOR",
            description="duplexops global entry: source ranges and per-client handshake rate",
            rules=security_rules(args.public_source_ranges, args.handshakes_per_minute),
            adaptive_protection_config={"layer7_ddos_defense_config": {"enable": True}},
            opts=child(),
        )
        self.health_check = compute.HealthCheck(
            f"{name}-readyz",
            name=f"{prefix}-readyz",
            project=project,
            http_health_check={"port_specification": "USE_SERVING_PORT", "request_path": "/readyz"},
            check_interval_sec=5,
            timeout_sec=3,
            healthy_threshold=1,
            unhealthy_threshold=2,
            log_config={"enable": True},
            opts=child(),
        )
        ready = [r for backend in args.backends for r in backend.ready]
        timeout_s = min(args.max_session_s + BACKEND_TIMEOUT_MARGIN_S, MAX_BACKEND_TIMEOUT_S)
        self.backend_service = compute.BackendService(
            f"{name}-backend",
            name=f"{prefix}-runtime",
            project=project,
            load_balancing_scheme="EXTERNAL_MANAGED",
            protocol="HTTP",
            port_name="http",
            timeout_sec=timeout_s,
            connection_draining_timeout_sec=min(args.drain_s, MAX_CONNECTION_DRAINING_S),
            # NONE: with WEIGHTED_ROUND_ROBIN any other affinity would be silently off (the class docstring).
            session_affinity="NONE",
            # Pods weighted by the slot utilisation they report (ORCA endpoint-load-metrics).
            locality_lb_policy="WEIGHTED_ROUND_ROBIN",
            custom_metrics=[{"name": SLOT_UTILIZATION_METRIC, "dry_run": False}],
            health_checks=self.health_check.id,
            security_policy=self.security_policy.id,
            log_config={"enable": True, "sample_rate": 1.0},
            backends=[
                {
                    "group": neg_url(project, zone, backend.neg_name),
                    "balancing_mode": "CUSTOM_METRICS",
                    "custom_metrics": [
                        {
                            "name": SLOT_UTILIZATION_METRIC,
                            "max_utilization": MAX_SLOT_UTILIZATION,
                            "dry_run": False,
                        }
                    ],
                    "capacity_scaler": 1.0 if backend.serving else 0.0,
                    "description": f"{backend.region} {zone}" + ("" if backend.serving else " (drained)"),
                }
                for backend in args.backends
                for zone in backend.zones
            ],
            # The NEGs exist once the regions' Services do (GKE's NEG controller makes them).
            opts=child(*ready),
        )
        self.page = self._page(name, args, timeout_s, child(*ready))
        self.resume_routers = self._resume_routers(name, args, timeout_s, child(*ready))
        regional_rules: list[compute.URLMapPathMatcherPathRuleArgsDict] = [
            {"paths": [regional_path(region)], "service": router.id}
            for region, router in self.resume_routers.items()
        ]
        url_map = compute.URLMap(
            f"{name}-url-map",
            name=f"{prefix}-entry",
            project=project,
            default_service=self.page.id,
            host_rules=[{"hosts": ["*"], "path_matcher": "entry"}],
            path_matchers=[
                {
                    "name": "entry",
                    "default_service": self.page.id,
                    "path_rules": [
                        {
                            "paths": list(RUNTIME_PATHS),
                            "service": self.backend_service.id,
                            "route_action": {"retry_policy": RUNTIME_RETRY_POLICY},
                        },
                        *regional_rules,
                    ],
                }
            ],
            opts=child(),
        )
        self.ssl_policy = compute.SSLPolicy(
            f"{name}-tls",
            name=f"{prefix}-entry",
            project=project,
            description="duplexops global entry: TLS 1.2 or later",
            **SSL_POLICY,
            opts=child(),
        )
        https_proxy = compute.TargetHttpsProxy(
            f"{name}-https-proxy",
            name=f"{prefix}-entry",
            project=project,
            url_map=url_map.id,
            ssl_certificates=[self.certificate.id],
            ssl_policy=self.ssl_policy.id,
            opts=child(),
        )
        redirect = compute.URLMap(
            f"{name}-redirect",
            name=f"{prefix}-redirect",
            project=project,
            default_url_redirect={
                "https_redirect": True,
                "strip_query": False,
                "redirect_response_code": "MOVED_PERMANENTLY_DEFAULT",
            },
            opts=child(),
        )
        http_proxy = compute.TargetHttpProxy(
            f"{name}-http-proxy",
            name=f"{prefix}-redirect",
            project=project,
            url_map=redirect.id,
            opts=child(),
        )
        for scheme, port, proxy in (("https", "443", https_proxy), ("http", "80", http_proxy)):
            compute.GlobalForwardingRule(
                f"{name}-{scheme}",
                name=f"{prefix}-{scheme}",
                project=project,
                ip_address=self.address.id,
                ip_protocol="TCP",
                port_range=port,
                load_balancing_scheme="EXTERNAL_MANAGED",
                target=proxy.id,
                opts=child(),
            )
        self.register_outputs({"address": self.address.address})

    def _resume_routers(
        self, name: str, args: GlobalEntryArgs, timeout_s: int, opts: pulumi.ResourceOptions
    ) -> dict[str, compute.BackendService]:
        """One backend service per region with a resume router (``RegionBackend.resume_router_neg_name``):
        that region's router NEGs, ``RATE`` balancing, the runtime's timeout (a resumed WebSocket lives
        through it) and Cloud Armor policy (the per-client rate covers ``/r/`` as ``/api/chat``), one
        health check for all. ``{region: backend service}``, empty when no region has a router."""
        routed = [backend for backend in args.backends if backend.resume_router_neg_name is not None]
        if not routed:
            return {}
        health = _health_check(
            f"{name}-resume-router-health",
            f"{args.name_prefix}-resume-router",
            args,
            args.resume_router_health_path,
            opts,
        )
        routers = {}
        for backend in routed:
            assert backend.resume_router_neg_name is not None
            routers[backend.region] = _rate_backend_service(
                f"{name}-resume-{backend.region}",
                f"{args.name_prefix}-resume-{backend.region}",
                args,
                health=health,
                negs=[(backend.region, zone, backend.resume_router_neg_name) for zone in backend.zones],
                what="resume router",
                rate=RESUME_ROUTER_REQUESTS_PER_ENDPOINT_S,
                timeout_s=timeout_s,
                opts=opts,
                connection_draining_timeout_sec=min(args.drain_s, MAX_CONNECTION_DRAINING_S),
                security_policy=self.security_policy.id,
                log_config={"enable": True, "sample_rate": 1.0},
                description=f"duplexops resume router of {backend.region} (/r/{backend.region}/*)",
            )
        return routers

    def _page(
        self, name: str, args: GlobalEntryArgs, timeout_s: int, opts: pulumi.ResourceOptions
    ) -> compute.BackendService:
        """The browser client's health check and backend service: every region's page NEGs, ``RATE``
        balancing at ``PAGE_REQUESTS_PER_ENDPOINT_S`` per pod, the page's headers added to each response."""
        health = _health_check(
            f"{name}-page-health", f"{args.name_prefix}-page", args, args.page_health_path, opts
        )
        return _rate_backend_service(
            f"{name}-page-backend",
            f"{args.name_prefix}-page",
            args,
            health=health,
            negs=[(b.region, zone, b.page_neg_name) for b in args.backends for zone in b.zones],
            what="page",
            rate=PAGE_REQUESTS_PER_ENDPOINT_S,
            timeout_s=timeout_s,
            opts=opts,
            custom_response_headers=[f"{header}: {value}" for header, value in args.page_headers.items()],
            description="duplexops browser client (nginx pods of every region)",
        )


def _health_check(
    resource: str, gcp_name: str, args: GlobalEntryArgs, path: str, opts: pulumi.ResourceOptions
) -> compute.HealthCheck:
    """An HTTP health check of ``path`` on each endpoint's serving port, every 10 s (5 s timeout)."""
    return compute.HealthCheck(
        resource,
        name=gcp_name,
        project=args.project,
        http_health_check={"port_specification": "USE_SERVING_PORT", "request_path": path},
        check_interval_sec=10,
        timeout_sec=5,
        opts=opts,
    )


def _rate_backend_service(
    resource: str,
    gcp_name: str,
    args: GlobalEntryArgs,
    *,
    health: compute.HealthCheck,
    negs: Sequence[tuple[str, str, str]],
    what: str,
    rate: int,
    timeout_s: int,
    opts: pulumi.ResourceOptions,
    **extra: Any,
) -> compute.BackendService:
    """A backend service of nginx pods (the page's, a region's resume router): the ``(region, zone, NEG
    name)`` NEGs balanced at ``rate`` requests per second per endpoint (``RATE``), no affinity,
    ``timeout_s``; ``extra``: the service's other arguments."""
    return compute.BackendService(
        resource,
        name=gcp_name,
        project=args.project,
        load_balancing_scheme="EXTERNAL_MANAGED",
        protocol="HTTP",
        port_name="http",
        timeout_sec=timeout_s,
        session_affinity="NONE",
        health_checks=health.id,
        backends=[
            {
                "group": neg_url(args.project, zone, neg),
                "balancing_mode": "RATE",
                "max_rate_per_endpoint": rate,
                "capacity_scaler": 1.0,
                "description": f"{region} {zone} {what}",
            }
            for region, zone, neg in negs
        ],
        opts=opts,
        **extra,
    )


def _pod_ports(args: GlobalEntryArgs) -> list[str]:
    """The pods' ports Google's front ends reach: the runtime's, the page's and, with any resume router,
    the router's."""
    ports = [str(args.runtime_port), str(args.page_port)]
    if any(backend.resume_router_neg_name is not None for backend in args.backends):
        ports.append(str(args.resume_router_port))
    return ports


def security_rules(
    public_source_ranges: Sequence[str], handshakes_per_minute: int
) -> list[compute.SecurityPolicyRuleArgsDict]:
    """Cloud Armor rules, first match wins: callers from ``public_source_ranges`` (10 ranges per rule,
    Cloud Armor's limit) are allowed up to ``handshakes_per_minute`` requests per minute per client IP and
    get 429 beyond; the default rule denies everyone else with 403 (``0.0.0.0/0``: the throttle rule
    matches every source and the default rule allows, as nothing else is left)."""
    everyone = "0.0.0.0/0" in public_source_ranges
    chunks = (
        [["*"]]
        if everyone
        else [
            list(public_source_ranges[i : i + ARMOR_RULES_PER_MATCH])
            for i in range(0, len(public_source_ranges), ARMOR_RULES_PER_MATCH)
        ]
    )
    rules: list[compute.SecurityPolicyRuleArgsDict] = [
        {
            "priority": 1000 + n,
            "action": "throttle",
            "description": "public source ranges, per-client handshake rate",
            "match": {"versioned_expr": "SRC_IPS_V1", "config": {"src_ip_ranges": chunk}},
            "rate_limit_options": {
                "conform_action": "allow",
                "exceed_action": "deny(429)",
                "enforce_on_key": "IP",
                "rate_limit_threshold": {"count": handshakes_per_minute, "interval_sec": 60},
            },
        }
        for n, chunk in enumerate(chunks)
    ]
    rules.append(
        {
            "priority": 2147483647,
            "action": "allow" if everyone else "deny(403)",
            "description": "default rule",
            "match": {"versioned_expr": "SRC_IPS_V1", "config": {"src_ip_ranges": ["*"]}},
        }
    )
    return rules
