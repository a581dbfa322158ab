"""The project's GPU quotas read from the Compute Engine API, and the comparison with a stack's needs.

Two reads over HTTPS, each a documented REST method returning ``quotas[]`` of ``{metric, limit, usage}``:
``regions.get`` (``GET {COMPUTE_API}/projects/{project}/regions/{region}``: the regional GPU quotas) and
``projects.get`` (``GET {COMPUTE_API}/projects/{project}``: ``GPUS_ALL_REGIONS``)
(cloud.google.com/compute/docs/reference/rest/v1/regions/get, /projects/get). Both take ``?fields=quotas``
(the methods' own advice: leave out what is not needed). The HTTP client is injected (``Transport``); the
default is the standard library's, with a bearer token from ``GOOGLE_OAUTH_ACCESS_TOKEN`` (the variable the
Google provider of Pulumi/Terraform reads) or from ``gcloud auth application-default print-access-token``
(the credentials ``pulumi up`` uses): no Google client library is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from infra.preflight.needs import ALL_REGIONS, GpuNeed, PreflightError

__all__ = [
    "COMPUTE_API",
    "TOKEN_ENV",
    "ComputeQuotas",
    "Quota",
    "QuotaRow",
    "Transport",
    "access_token",
    "compare",
    "url_transport",
]

COMPUTE_API = "https://compute.googleapis.com/compute/v1"
"""The Compute Engine API's v1 root (the REST reference's ``HTTP request`` lines)."""

TOKEN_ENV = "GOOGLE_OAUTH_ACCESS_TOKEN"
"""An OAuth 2.0 access token to use as is (the Google provider's ``access_token`` variable)."""

GCLOUD_TOKEN = ("gcloud", "auth", "application-default", "print-access-token")
"""Prints an access token of the application-default credentials (``gcloud auth application-default
login``, the credentials ``pulumi up`` uses)."""

Transport = Callable[[str, Mapping[str, str]], tuple[int, bytes]]
"""``(url, headers) -> (HTTP status, body)``: one GET."""


def url_transport(url: str, headers: Mapping[str, str], timeout_s: float = 30.0) -> tuple[int, bytes]:
    """One HTTPS GET with the standard library: ``(status, body)``, an HTTP error's own status and body
    included.

    Raises:
        PreflightError: the host cannot be reached (names it and the cause).
    """
    request = urllib.request.Request(url, headers=dict(headers), method="GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (https API)
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        host = urllib.parse.urlsplit(url).netloc
        raise PreflightError(
            f"cannot reach {host}: {getattr(exc, 'reason', exc)}; check the network"
        ) from None


def access_token(
    env: Mapping[str, str] | None = None,
    run: Callable[[list[str]], subprocess.CompletedProcess[str]] | None = None,
) -> str:
    """An access token for the Compute Engine API: ``TOKEN_ENV`` if set, else ``GCLOUD_TOKEN``'s output.

    Raises:
        PreflightError: no credentials (gcloud missing, not logged in, or printing nothing): says how to
            log in.
    """
    env = os.environ if env is None else env
    if env.get(TOKEN_ENV, "").strip():
        return env[TOKEN_ENV].strip()

    def default_run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)

    advice = (
        f"run `gcloud auth application-default login` (the credentials `pulumi up` uses) or set {TOKEN_ENV}"
    )
    try:
        done = (run or default_run)(list(GCLOUD_TOKEN))
    except FileNotFoundError:
        raise PreflightError(
            f"no credentials: gcloud is not installed and {TOKEN_ENV} is not set; {advice}"
        ) from None
    token = (done.stdout or "").strip()
    if done.returncode != 0 or not token:
        detail = (done.stderr or "").strip().splitlines()
        raise PreflightError(
            f"no credentials: `{' '.join(GCLOUD_TOKEN)}` failed"
            f"{': ' + detail[-1] if detail else ''}; {advice}"
        )
    return token


@dataclass(frozen=True)
class Quota:
    """One ``quotas[]`` entry: ``limit`` and ``usage`` (GPUs; the API sends numbers as floats)."""

    metric: str
    limit: float
    usage: float


def _api_error(status: int, body: bytes, what: str, project: str) -> PreflightError:
    """The Google API error of one request in words: what was wrong and what to do."""
    try:
        error = json.loads(body or b"{}").get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    message = str(error.get("message", "")).strip() or body[:200].decode("utf-8", "replace")
    reasons = {str(e.get("reason")) for e in error.get("errors") or [] if isinstance(e, dict)}
    reasons |= {str(d.get("reason")) for d in error.get("details") or [] if isinstance(d, dict)}
    if reasons & {"SERVICE_DISABLED", "accessNotConfigured"}:
        return PreflightError(
            f"{what}: the Compute Engine API is not enabled in project {project!r}; enable it with "
            f"`gcloud services enable compute.googleapis.com --project {project}` (the bootstrap project "
            f"enables it too) ({message})"
        )
    if status == 401:
        return PreflightError(
            f"{what}: the credentials were refused (401: {message}); run "
            f"`gcloud auth application-default login` or set a fresh {TOKEN_ENV}"
        )
    if status == 403:
        return PreflightError(
            f"{what}: permission denied in project {project!r} (403: {message}); the account needs "
            "compute.regions.get and compute.projects.get (roles/compute.viewer)"
        )
    if status == 404:
        return PreflightError(
            f"{what}: not found (404: {message}); check the project id and the region names"
        )
    return PreflightError(f"{what}: HTTP {status}: {message}")


class ComputeQuotas:
    """Reads quotas from the Compute Engine API.

    Args:
        token: an OAuth 2.0 access token (``access_token()``).
        transport: one GET (``url_transport`` by default; tests pass a fake API's).
        api: the API root (``COMPUTE_API``; a test server's URL in tests).
    """

    def __init__(self, token: str, transport: Transport = url_transport, api: str = COMPUTE_API):
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self._transport = transport
        self._api = api.rstrip("/")

    def _quotas(self, path: str, what: str, project: str) -> dict[str, Quota]:
        status, body = self._transport(f"{self._api}/{path}?fields=quotas", self._headers)
        if status != 200:
            raise _api_error(status, body, what, project)
        try:
            items = json.loads(body).get("quotas") or []
            return {
                str(q["metric"]): Quota(str(q["metric"]), float(q.get("limit", 0)), float(q.get("usage", 0)))
                for q in items
            }
        except (ValueError, AttributeError, KeyError, TypeError) as exc:
            raise PreflightError(f"{what}: the answer is not a Compute Engine quotas list ({exc})") from None

    def region(self, project: str, region: str) -> dict[str, Quota]:
        """``regions.get``'s quotas of ``region``, by metric.

        Raises:
            PreflightError: the API refused or failed (names why and what to do).
        """
        quoted = urllib.parse.quote(project, safe="")
        return self._quotas(
            f"projects/{quoted}/regions/{urllib.parse.quote(region, safe='')}",
            f"regions.get {region}",
            project,
        )

    def project(self, project: str) -> dict[str, Quota]:
        """``projects.get``'s project-wide quotas (``GPUS_ALL_REGIONS`` among them), by metric.

        Raises:
            PreflightError: the API refused or failed.
        """
        return self._quotas(f"projects/{urllib.parse.quote(project, safe='')}", "projects.get", project)


@dataclass(frozen=True)
class QuotaRow:
    """One need against the project's quota.

    Attributes:
        need: what the stack takes.
        metric: the metric that holds it (``need.metric``, or its fallback when only that has room).
        limit, usage: the quota's limit and current usage (GPUs), None when the API lists no such metric.
        ok: the free quota (limit - usage) holds ``need.count``.
        request: the limit to request for ``need.metric`` when not ok (usage + need), else None.
        problem: why it is not ok, in words, else None.
    """

    need: GpuNeed
    metric: str
    limit: float | None
    usage: float | None
    ok: bool
    request: int | None
    problem: str | None


def _row(need: GpuNeed, quotas: Mapping[str, Quota]) -> QuotaRow:
    where = "the project" if need.region == ALL_REGIONS else f"region {need.region}"
    for metric in (need.metric, need.fallback):
        q = quotas.get(metric or "")
        if q is not None and q.limit - q.usage >= need.count:
            return QuotaRow(need, metric or need.metric, q.limit, q.usage, True, None, None)
    q = quotas.get(need.metric)
    if q is None and need.fallback is None:
        return QuotaRow(
            need,
            need.metric,
            None,
            None,
            False,
            None,
            f"{where} lists no {need.metric} quota: the GPU is not offered there (or not to this project); "
            "choose a region that has it "
            f"(`gcloud compute accelerator-types list --filter=zone~{need.region}`)"
            if need.region != ALL_REGIONS
            else f"the project lists no {need.metric} quota",
        )
    usage = q.usage if q is not None else 0.0
    request = int(usage) + need.count
    have = f"limit {q.limit:g}, in use {q.usage:g}" if q is not None else "no such quota listed"
    return QuotaRow(
        need,
        need.metric,
        q.limit if q else None,
        q.usage if q else None,
        False,
        request,
        f"{where}: {need.metric} {have}, the stack needs {need.count} free: request {need.metric} = "
        f"{request} in {'all regions' if need.region == ALL_REGIONS else need.region}",
    )


def compare(needs: Iterable[GpuNeed], project: str, api: ComputeQuotas) -> list[QuotaRow]:
    """Each need against the project's quotas (``regions.get`` once per region, ``projects.get`` once).

    Raises:
        PreflightError: the API refused or failed.
    """
    needs = list(needs)
    by_scope: dict[str, dict[str, Quota]] = {}
    for need in needs:
        if need.region not in by_scope:
            by_scope[need.region] = (
                api.project(project) if need.region == ALL_REGIONS else api.region(project, need.region)
            )
    return [_row(n, by_scope[n.region]) for n in needs]
