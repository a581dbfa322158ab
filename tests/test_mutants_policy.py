"""Tests that kill mutants of the policy rules (``infra/policy/rules``) that ``test_policy_pack.py`` lets
survive: seven rules it checks only on empty and foreign resources, exercised otherwise through whole
stacks (``make mutation MODULE=infra/policy/rules``; docs/mutation.md). Each rule gets minimal resources,
one per branch, and its messages compared whole (a message is what an operator reads to fix the stack).
Each docstring names the mutants (or the planted bug) it kills."""

from __future__ import annotations

from typing import Any

import pytest

from infra.policy.rules import (
    BACKEND_SERVICE,
    CLUSTER,
    FIREWALL,
    INSTANCE,
    INSTANCE_TEMPLATE,
    NODE_POOL,
    SSL_POLICY,
    UNKNOWN,
    StackResource,
    apis_enabled_for_features,
    backend_timeout_fits_websockets,
    check_resources,
    firewall_no_public_monitoring,
    firewall_no_world_ssh,
    gpu_instance_graceful_shutdown,
    gpu_instance_terminates_on_maintenance,
    gpu_node_pool_tainted,
    gpu_node_pool_upgrade_needs_no_extra_gpu,
    https_proxy_tls_1_2,
    machine_type_carries_gpu,
    provisioning_model_sold,
    session_affinity_needs_hash_policy,
)
from infra.policy.rules._common import TARGET_HTTPS_PROXY

UNKNOWN_STRING = "04da6b54-80e4-46f7-96ec-b56ff0331ba9"  # the engine's sentinel for an unknown string
UNKNOWN_NUMBER = "3eeb2bf0-c639-47a8-9e75-3b44932eb421"
UNKNOWN_OBJECT = "dd056dcd-154b-4c76-9bd3-c8f88648b5ff"
UNKNOWN_BOOL = "1c4a061d-8072-4f0a-a4cb-0ff528b18fe7"

T4 = [{"type": "nvidia-tesla-t4", "count": 1.0}]


# ------------------------------------------------------------------------------------------------------
# gpu_instance_graceful_shutdown
# ------------------------------------------------------------------------------------------------------


def t4_vm(scheduling: Any = None, **extra: Any) -> dict[str, Any]:
    props: dict[str, Any] = {"machineType": "n1-standard-8", "guestAccelerators": T4}
    if scheduling is not None:
        props["scheduling"] = scheduling
    props.update(extra)
    return props


def graceful(seconds: Any = 160.0, enabled: Any = True) -> dict[str, Any]:
    return {"gracefulShutdown": {"enabled": enabled, "maxDuration": {"seconds": seconds}}}


SHORT = (
    "GPU instance (guestAccelerators nvidia-tesla-t4): scheduling.gracefulShutdown lasts {s} s, less than "
    "the {n} s the node needs to drain. Live conversations are cut on stop, delete or replace; set "
    "gracefulShutdown = {{enabled: true, maxDuration: {{seconds: {n}}}}} (at most 3600)."
)
OFF = (
    "GPU instance ({e}): scheduling.gracefulShutdown is not enabled (GCE gives the guest only seconds). "
    "Live conversations are cut on stop, delete or replace; set gracefulShutdown = {{enabled: true, "
    "maxDuration: {{seconds: {n}}}}} (at most 3600)."
)


def test_graceful_shutdown_of_exactly_the_needed_seconds_passes():
    """Kills ``seconds >= needed`` -> ``>``, ``MIN_GRACEFUL_SHUTDOWN_S`` 60 -> 61 or 59, and the pass
    condition's ``and`` -> ``or``: 60 s passes by default, 59 s does not (message whole)."""
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful(60.0))) == []
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful(60))) == []
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful(59.0))) == [SHORT.format(s=59.0, n=60)]
    assert gpu_instance_graceful_shutdown(INSTANCE_TEMPLATE, t4_vm(graceful(59))) == [
        SHORT.format(s=59, n=60)
    ]


def test_graceful_shutdown_reads_the_nodes_stop_timeout_from_metadata():
    """Kills the metadata branch: ``needed = int(str(raw))`` dropped or changed, ``isdigit`` ->
    ``not isdigit``, ``raw is not None and`` -> ``or``, the metadata key changed, ``isinstance(metadata,
    dict)`` negated: the node's own 160 s (metadata ``duplexops-stop-timeout-s``) is the bound, not 60 s."""
    meta = {"duplexops-stop-timeout-s": "160"}
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful(160.0), metadata=meta)) == []
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful(159.0), metadata=meta)) == [
        SHORT.format(s=159.0, n=160)
    ]
    # Not a number of seconds, or another key: the default 60 s.
    for metadata in (
        {"duplexops-stop-timeout-s": "2m"},
        {"other": "160"},
        {"duplexops-stop-timeout-s": None},
    ):
        assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful(60.0), metadata=metadata)) == []
        assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful(59.0), metadata=metadata)) == [
            SHORT.format(s=59.0, n=60)
        ]
    # Metadata not an object: the default too.
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful(59.0), metadata="x")) == [
        SHORT.format(s=59.0, n=60)
    ]


def test_graceful_shutdown_not_enabled_or_missing():
    """Kills ``enabled is not True`` -> ``is True`` in the message, ``enabled = None if graceful is None``
    -> the reverse, ``(graceful or {})`` -> ``(graceful and {})``, the message's texts, and ``enabled is
    True and`` -> ``or`` (enabled false with a long duration fails)."""
    evidence = "guestAccelerators nvidia-tesla-t4"
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm({})) == [OFF.format(e=evidence, n=60)]
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm()) == [OFF.format(e=evidence, n=60)]
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful(600.0, enabled=False))) == [
        OFF.format(e=evidence, n=60)
    ]
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm({"gracefulShutdown": {"enabled": True}})) == [
        SHORT.format(s=None, n=60)
    ]
    assert gpu_instance_graceful_shutdown(
        INSTANCE, t4_vm({"gracefulShutdown": {"enabled": True, "maxDuration": {}}})
    ) == [SHORT.format(s=None, n=60)]
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(graceful("600"))) == [SHORT.format(s='"600"', n=60)]
    built_in = {"machineType": "a2-ultragpu-1g", "scheduling": {}}
    assert gpu_instance_graceful_shutdown(INSTANCE, built_in) == [
        OFF.format(e="machineType a2-ultragpu-1g, whose GPU is built in", n=60)
    ]


def test_graceful_shutdown_is_refused_on_limited_run_time_vms():
    """Kills the limited run time branch: the keys ``maxRunDuration``/``terminationTime`` changed, the
    ``provisioningModel`` read changed (``.upper()`` -> ``.lower()``, ``FLEX_START`` changed, ``or limited``
    -> ``and``), ``enabled") is True`` -> ``is not True``/``is False``, the ``why`` join and the message."""
    flex = {"provisioningModel": "flex_start", **graceful(160.0)}
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(flex)) == [
        "GPU instance (guestAccelerators nvidia-tesla-t4) has a limited run time (FLEX_START): GCE excludes "
        "graceful shutdown for it; remove scheduling.gracefulShutdown."
    ]
    both = {"maxRunDuration": {"seconds": 3600.0}, "terminationTime": "2026-12-01T00:00:00Z", **graceful()}
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(both)) == [
        "GPU instance (guestAccelerators nvidia-tesla-t4) has a limited run time (scheduling.maxRunDuration, "
        "scheduling.terminationTime): GCE excludes graceful shutdown for it; remove "
        "scheduling.gracefulShutdown."
    ]
    term = {"terminationTime": "2026-12-01T00:00:00Z", **graceful()}
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(term)) == [
        "GPU instance (guestAccelerators nvidia-tesla-t4) has a limited run time "
        "(scheduling.terminationTime): GCE excludes graceful shutdown for it; remove "
        "scheduling.gracefulShutdown."
    ]
    # Without graceful shutdown, or with it off, a limited VM passes (no duration asked for).
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm({"provisioningModel": "FLEX_START"})) == []
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm({"maxRunDuration": {"seconds": 60.0}})) == []
    off = {"maxRunDuration": {"seconds": 60.0}, **graceful(enabled=False)}
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(off)) == []
    # A falsy run time is no limit; a standard VM is judged on its duration.
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm({"maxRunDuration": None, **graceful()})) == []
    std = {"provisioningModel": "STANDARD", **graceful(59.0)}
    assert gpu_instance_graceful_shutdown(INSTANCE, t4_vm(std)) == [SHORT.format(s=59.0, n=60)]


@pytest.mark.parametrize(
    "props",
    [
        t4_vm(UNKNOWN_OBJECT),
        t4_vm({"gracefulShutdown": UNKNOWN_OBJECT}),
        t4_vm({"gracefulShutdown": {"enabled": UNKNOWN_BOOL, "maxDuration": {"seconds": 1.0}}}),
        t4_vm({"gracefulShutdown": {"enabled": True, "maxDuration": UNKNOWN_OBJECT}}),
        t4_vm({"gracefulShutdown": {"enabled": True, "maxDuration": {"seconds": UNKNOWN_NUMBER}}}),
        t4_vm(graceful(1.0), metadata={"duplexops-stop-timeout-s": UNKNOWN_STRING}),
        {"machineType": UNKNOWN_STRING, "scheduling": {}},
        {"machineType": "e2-standard-4", "scheduling": {}},
    ],
)
def test_graceful_shutdown_passes_what_it_cannot_know(props):
    """Kills each ``return []`` on an unknown value turned into a judgement (``is_unknown`` negated,
    ``isinstance(..., _Unknown)`` negated, ``or`` -> ``and``), and the rule judging a VM without a GPU."""
    assert gpu_instance_graceful_shutdown(INSTANCE, props) == []
    assert gpu_instance_graceful_shutdown("gcp:compute/disk:Disk", t4_vm({})) == []


# ------------------------------------------------------------------------------------------------------
# provisioning_model_sold
# ------------------------------------------------------------------------------------------------------

FLEX_OK = {
    "provisioningModel": "FLEX_START",
    "automaticRestart": False,
    "instanceTerminationAction": "DELETE",
    "maxRunDuration": {"seconds": 3600.0},
}
SPOT_OK = {"provisioningModel": "SPOT", "preemptible": True, "automaticRestart": False}
NO_RESERVATION = {"type": "NO_RESERVATION"}
SPOT_NEEDS = "SPOT needs scheduling.preemptible = true and scheduling.automaticRestart = false"
FLEX_NEEDS = (
    "FLEX_START needs scheduling.automaticRestart = false, instanceTerminationAction = DELETE and a "
    "maxRunDuration"
)


def vm(machine_type: Any, scheduling: Any = None, **extra: Any) -> dict[str, Any]:
    props: dict[str, Any] = {"machineType": machine_type}
    if scheduling is not None:
        props["scheduling"] = scheduling
    props.update(extra)
    return props


def test_provisioning_standard_is_refused_where_not_sold():
    """Kills the default model (``or "STANDARD"`` changed), ``key not in entry.sold_as`` -> ``in``, ``entry
    is not None and`` -> ``or``, the ``" or "`` join and the message: a3-highgpu-1g is Spot or Flex-start
    only; an unset or explicit STANDARD is refused, with the type's name as asked."""
    message = (
        'machine type "a3-highgpu-1g" is sold only as SPOT or FLEX_START, not "{m}": GCE refuses to create '
        "the VM. Set scheduling.provisioningModel accordingly (stack config duplexops:provisioningModel)."
    )
    assert provisioning_model_sold(INSTANCE, vm("a3-highgpu-1g")) == [message.format(m="STANDARD")]
    assert provisioning_model_sold(INSTANCE, vm("a3-highgpu-1g", {})) == [message.format(m="STANDARD")]
    assert provisioning_model_sold(INSTANCE, vm("a3-highgpu-1g", {"provisioningModel": "standard"})) == [
        message.format(m="standard")
    ]
    assert provisioning_model_sold(INSTANCE, vm("a3-highgpu-1g", SPOT_OK)) == []
    assert (
        provisioning_model_sold(INSTANCE, vm("a3-highgpu-1g", FLEX_OK, reservationAffinity=NO_RESERVATION))
        == []
    )
    # Sold as standard: passes; a type the catalog does not know: passes.
    assert provisioning_model_sold(INSTANCE, vm("a3-highgpu-8g")) == []
    assert provisioning_model_sold(INSTANCE, vm("n1-standard-8", {"provisioningModel": "STANDARD"})) == []
    assert provisioning_model_sold(INSTANCE, vm("e2-standard-4")) == []
    assert provisioning_model_sold(INSTANCE, vm("zz-made-up-4")) == []


def test_provisioning_unknown_model_is_named_with_the_models_allowed():
    """Kills ``key is None`` -> ``is not None``, the ``", "`` join of ``PROVISIONING_MODELS`` and the
    message; ``str(model).upper()`` -> ``lower()`` (a lower-case model is read as its upper-case name)."""
    assert provisioning_model_sold(INSTANCE, vm("n1-standard-8", {"provisioningModel": "RESERVED"})) == [
        'scheduling.provisioningModel "RESERVED" is not one of STANDARD, SPOT, FLEX_START'
    ]
    assert provisioning_model_sold(INSTANCE, vm("zz-made-up-4", {"provisioningModel": 3})) == [
        "scheduling.provisioningModel 3 is not one of STANDARD, SPOT, FLEX_START"
    ]
    lower_spot = {"provisioningModel": "spot", "preemptible": True, "automaticRestart": False}
    assert provisioning_model_sold(INSTANCE, vm("n1-standard-8", lower_spot)) == []


def test_provisioning_spot_needs_preemptible_and_no_restart():
    """Kills the SPOT settings check: ``key == "spot"`` changed, ``preemptible") is not True`` -> ``is
    True``, ``or`` -> ``and``, ``automaticRestart`` read under another name, and the message."""
    assert provisioning_model_sold(INSTANCE, vm("n1-standard-8", SPOT_OK)) == []
    assert provisioning_model_sold(INSTANCE, vm("n1-standard-8", {**SPOT_OK, "preemptible": False})) == [
        SPOT_NEEDS
    ]
    assert provisioning_model_sold(INSTANCE, vm("n1-standard-8", {**SPOT_OK, "automaticRestart": True})) == [
        SPOT_NEEDS
    ]
    no_restart_key = {"provisioningModel": "SPOT", "preemptible": True}
    assert provisioning_model_sold(INSTANCE, vm("n1-standard-8", no_restart_key)) == []
    # The SPOT check does not apply to another model, nor the Flex-start ones to SPOT.
    assert provisioning_model_sold(INSTANCE, vm("n1-standard-8", {"automaticRestart": True})) == []


def test_provisioning_flex_start_needs_its_settings():
    """Kills the FLEX_START settings check: each of ``automaticRestart``, ``instanceTerminationAction``
    (``.upper()``, ``"DELETE"``, the ``""`` default), ``maxRunDuration`` alone failing it, the ``or`` ->
    ``and`` between them, ``key == "flex-start"`` changed, and the message."""
    affinity = {"reservationAffinity": NO_RESERVATION}
    assert provisioning_model_sold(INSTANCE, vm("g2-standard-8", FLEX_OK, **affinity)) == []
    lower = {**FLEX_OK, "instanceTerminationAction": "delete", "provisioningModel": "flex_start"}
    assert provisioning_model_sold(INSTANCE, vm("g2-standard-8", lower, **affinity)) == []
    for bad in (
        {"automaticRestart": True},
        {"instanceTerminationAction": "STOP"},
        {"instanceTerminationAction": None},
        {"maxRunDuration": None},
    ):
        scheduling = {k: v for k, v in {**FLEX_OK, **bad}.items() if v is not None}
        assert provisioning_model_sold(INSTANCE, vm("g2-standard-8", scheduling, **affinity)) == [
            FLEX_NEEDS
        ], bad
    # Flex-start is not sold for N1 types: both problems, in order.
    assert provisioning_model_sold(INSTANCE, vm("n1-standard-8", {"provisioningModel": "FLEX_START"})) == [
        'machine type "n1-standard-8" is sold only as STANDARD or SPOT, not "FLEX_START": GCE refuses to '
        "create the VM. Set scheduling.provisioningModel accordingly (stack config "
        "duplexops:provisioningModel).",
        FLEX_NEEDS,
        "FLEX_START needs reservationAffinity = {type: NO_RESERVATION} (now None): a Flex-start VM does not "
        "consume reservations",
    ]


def test_provisioning_flex_start_needs_no_reservation():
    """Kills the reservation affinity check: ``key == "flex-start" and`` -> ``or`` (a STANDARD VM with a
    reservation is fine), ``isinstance(affinity, _Unknown)`` negated, ``(affinity or {})`` -> ``and``, the
    ``type`` key, ``.upper()``, ``"NO_RESERVATION"`` and the message."""
    spec = {"type": "SPECIFIC_RESERVATION"}
    assert provisioning_model_sold(INSTANCE, vm("g2-standard-8", FLEX_OK, reservationAffinity=spec)) == [
        'FLEX_START needs reservationAffinity = {type: NO_RESERVATION} (now "SPECIFIC_RESERVATION"): a '
        "Flex-start VM does not consume reservations"
    ]
    lower = {"type": "no_reservation"}
    assert provisioning_model_sold(INSTANCE, vm("g2-standard-8", FLEX_OK, reservationAffinity=lower)) == []
    assert (
        provisioning_model_sold(INSTANCE, vm("g2-standard-8", FLEX_OK, reservationAffinity=UNKNOWN_OBJECT))
        == []
    )
    unknown_type = {"type": UNKNOWN_STRING}
    assert (
        provisioning_model_sold(INSTANCE, vm("g2-standard-8", FLEX_OK, reservationAffinity=unknown_type))
        == []
    )
    assert provisioning_model_sold(INSTANCE, vm("g2-standard-8", {}, reservationAffinity=spec)) == []


@pytest.mark.parametrize(
    "props",
    [
        vm(UNKNOWN_STRING),
        vm(None, {"provisioningModel": "RESERVED"}),
        vm(5, {"provisioningModel": "RESERVED"}),
        vm("a3-highgpu-1g", UNKNOWN_OBJECT),
        vm("a3-highgpu-1g", {"provisioningModel": UNKNOWN_STRING}),
        vm("a3-highgpu-1g", {"provisioningModel": "SPOT", "preemptible": UNKNOWN_BOOL}),
    ],
)
def test_provisioning_passes_what_it_cannot_know(props):
    """Kills each early ``return []`` on an unknown or unreadable machine type or scheduling turned into a
    judgement (``or`` -> ``and``, ``not isinstance`` -> ``isinstance``, ``any`` -> ``all``)."""
    assert provisioning_model_sold(INSTANCE, props) == []


def test_provisioning_polices_instances_only():
    """Kills ``resource_type != INSTANCE`` -> ``==``: a template (or anything else) is not judged."""
    assert provisioning_model_sold(INSTANCE_TEMPLATE, vm("a3-highgpu-1g")) == []
    assert provisioning_model_sold(NODE_POOL, vm("a3-highgpu-1g")) == []
    assert provisioning_model_sold(INSTANCE, vm("a3-highgpu-1g")) != []


# ------------------------------------------------------------------------------------------------------
# apis_enabled_for_features
# ------------------------------------------------------------------------------------------------------

SERVICE = "gcp:projects/service:Service"


def service(api: str, name: str | None = None) -> StackResource:
    return StackResource(SERVICE, {"service": api}, name or api.split(".")[0], ())


def test_apis_not_checked_when_the_stack_enables_none():
    """Kills ``if not services`` -> ``if services`` and the ``isinstance(..., str)`` filter negated: a
    stack without a Service (``enableApis: false``) is not judged; a Service without a known name does not
    count as enabling one."""
    pool = StackResource(NODE_POOL, {}, "pool", ())
    assert apis_enabled_for_features([pool]) == []
    assert apis_enabled_for_features([StackResource(SERVICE, {"service": UNKNOWN}, "svc", ()), pool]) == []


def test_apis_missing_and_not_waited_for_are_named():
    """Kills the missing-API branch (``api not in services`` -> ``in``), the dependency branch
    (``r.dependencies is not None and`` -> ``or``, ``not waits_for`` -> ``waits_for``), ``services[api]``
    in the message, the ``sorted`` order, and both messages' texts."""
    compute = service("compute.googleapis.com", "api-compute")
    pool = StackResource(NODE_POOL, {"nodeConfig": {"gcfsConfig": {"enabled": True}}}, "pool", ())
    vm_res = StackResource(INSTANCE, {}, "node", ())
    assert apis_enabled_for_features([compute, pool, vm_res]) == [
        f"{NODE_POOL} pool needs container.googleapis.com (gcp:container/ resources), which the stack "
        "does not enable: add it to the APIs the program enables.",
        f"{NODE_POOL} pool needs containerfilesystem.googleapis.com (image streaming "
        "(nodeConfig.gcfsConfig)), which the stack does not enable: add it to the APIs the program enables.",
        f"{INSTANCE} node needs compute.googleapis.com (gcp:compute/ resources) but does not depend on its "
        "enablement (api-compute): pass the APIs' ResourceOptions (depends_on).",
    ]


def test_apis_dependencies_count_directly_by_urn_and_through_others():
    """Kills ``waits_for``: the URN's ``rsplit("::", 1)[-1]`` changed (``split``, ``[0]``, another
    separator), ``name == target`` -> ``!=``, the walk through other resources (``todo.extend`` dropped,
    ``name not in by_name`` -> ``in``), ``return True``/``False`` swapped; and unknown dependencies
    (None) not judged."""
    compute = service("compute.googleapis.com", "api-compute")
    urn = "urn:pulumi:dev::duplexops::gcp:projects/service:Service::api-compute"
    direct = StackResource(INSTANCE, {}, "node", (urn,))
    disk = StackResource("gcp:compute/disk:Disk", {}, "disk", ("api-compute",))
    through = StackResource(
        INSTANCE, {}, "node2", ("urn:pulumi:dev::duplexops::gcp:compute/disk:Disk::disk",)
    )
    unknown_deps = StackResource(INSTANCE, {}, "node3", None)
    assert apis_enabled_for_features([compute, direct, disk, through, unknown_deps]) == []
    # A dependency on something else (outside the stack, or waiting for nothing) is not enough.
    elsewhere = StackResource(
        INSTANCE, {}, "node4", ("bucket", "urn:pulumi:dev::x::gcp:compute/disk:Disk::disk2")
    )
    disk2 = StackResource("gcp:compute/disk:Disk", {}, "disk2", ())
    assert apis_enabled_for_features([compute, disk2, elsewhere]) == [
        "gcp:compute/disk:Disk disk2 needs compute.googleapis.com (gcp:compute/ resources) but does not "
        "depend on its enablement (api-compute): pass the APIs' ResourceOptions (depends_on).",
        f"{INSTANCE} node4 needs compute.googleapis.com (gcp:compute/ resources) but does not depend on its "
        "enablement (api-compute): pass the APIs' ResourceOptions (depends_on).",
    ]


def test_apis_dependency_cycles_end():
    """Kills ``seen.add(name)`` dropped and ``name in seen or`` -> ``and``: two resources that wait for
    each other (and not for the API) are judged, not walked for ever."""
    compute = service("compute.googleapis.com", "api-compute")
    a = StackResource("gcp:compute/disk:Disk", {}, "a", ("b",))
    b = StackResource("gcp:compute/disk:Disk", {}, "b", ("a",))
    assert len(apis_enabled_for_features([compute, a, b])) == 2


def test_apis_step_0_declared_is_refused_and_needed_is_not():
    """Kills the step-0 branch: ``api in STEP_0_APIS`` -> ``not in`` (both places), ``continue`` ->
    ``break``, the ``sorted`` order and the message naming the step-0 command."""
    usage = service("serviceusage.googleapis.com", "api-usage")
    crm = service("cloudresourcemanager.googleapis.com", "api-crm")
    compute = service("compute.googleapis.com", "api-compute")
    binding = StackResource("gcp:projects/iAMMember:IAMMember", {}, "binding", ())
    node = StackResource(INSTANCE, {}, "node", ("api-compute",))
    command = (
        "gcloud services enable cloudresourcemanager.googleapis.com serviceusage.googleapis.com "
        "--project <project>"
    )
    assert apis_enabled_for_features([usage, crm, compute, binding, node]) == [
        f"{SERVICE} api-crm enables cloudresourcemanager.googleapis.com, a step-0 API that no program can "
        f"enable (enabling an API needs it): remove it and run `{command}` once per project (step 0).",
        f"{SERVICE} api-usage enables serviceusage.googleapis.com, a step-0 API that no program can enable "
        f"(enabling an API needs it): remove it and run `{command}` once per project (step 0).",
    ]
    # Needing a step-0 API (every Service needs Service Usage) is no violation, and the rest is still checked.
    late = StackResource(INSTANCE, {}, "late", ())
    assert apis_enabled_for_features([compute, binding, late]) == [
        f"{INSTANCE} late needs compute.googleapis.com (gcp:compute/ resources) but does not depend on its "
        "enablement (api-compute): pass the APIs' ResourceOptions (depends_on)."
    ]


# ------------------------------------------------------------------------------------------------------
# gpu_node_pool_upgrade_needs_no_extra_gpu
# ------------------------------------------------------------------------------------------------------

FIX = 'Set upgradeSettings = {"strategy": "SURGE", "maxSurge": 0, "maxUnavailable": 1}.'
L4 = "machineType g2-standard-8, whose GPU is built in"


def l4_pool(settings: Any = None, **node_config: Any) -> dict[str, Any]:
    props: dict[str, Any] = {"nodeConfig": {"machineType": "g2-standard-8", **node_config}}
    if settings is not None:
        props["upgradeSettings"] = settings
    return props


def test_upgrade_in_place_passes():
    """Kills ``surge > 0`` -> ``>= 0``/``> 1``, ``unavailable < 1`` -> ``<= 1``/``< 2``, ``or`` -> ``and``:
    maxSurge 0 with maxUnavailable 1 or 2 passes."""
    assert (
        gpu_node_pool_upgrade_needs_no_extra_gpu(NODE_POOL, l4_pool({"maxSurge": 0.0, "maxUnavailable": 1.0}))
        == []
    )
    assert (
        gpu_node_pool_upgrade_needs_no_extra_gpu(NODE_POOL, l4_pool({"maxSurge": 0, "maxUnavailable": 2}))
        == []
    )
    ok = {"strategy": "SURGE", "maxSurge": 0, "maxUnavailable": 1}
    assert gpu_node_pool_upgrade_needs_no_extra_gpu(NODE_POOL, l4_pool(ok)) == []


def test_upgrade_defaults_and_surges_are_refused():
    """Kills ``GKE_DEFAULT_MAX_SURGE`` 1 -> 2, ``surge is None`` -> ``is not None``, the unavailable default
    0 -> 1, ``int(...)`` dropped (a float count printed as 1.0), both message branches' texts and the
    ``if surge > 0`` choice of explanation."""
    rule = gpu_node_pool_upgrade_needs_no_extra_gpu
    surge = "each surge node is one more GPU in the zone. "
    assert rule(NODE_POOL, l4_pool()) == [
        f"GPU node pool ({L4}) upgrades with maxSurge 1 and maxUnavailable 0: {surge}{FIX}"
    ]
    assert rule(NODE_POOL, l4_pool("not an object")) == [
        f"GPU node pool ({L4}) upgrades with maxSurge 1 and maxUnavailable 0: {surge}{FIX}"
    ]
    assert rule(NODE_POOL, l4_pool({"maxSurge": 2.0, "maxUnavailable": 1.0})) == [
        f"GPU node pool ({L4}) upgrades with maxSurge 2 and maxUnavailable 1: {surge}{FIX}"
    ]
    assert rule(NODE_POOL, l4_pool({"maxSurge": 0.0})) == [
        f"GPU node pool ({L4}) upgrades with maxSurge 0 and maxUnavailable 0: GKE refuses both 0. {FIX}"
    ]
    assert rule(NODE_POOL, l4_pool({"maxUnavailable": 3.0})) == [
        f"GPU node pool ({L4}) upgrades with maxSurge 1 and maxUnavailable 3: {surge}{FIX}"
    ]


def test_upgrade_blue_green_is_refused():
    """Kills ``strategy != "SURGE"`` -> ``==``, the strategy default ``or "SURGE"`` changed, and the
    message."""
    rule = gpu_node_pool_upgrade_needs_no_extra_gpu
    assert rule(NODE_POOL, l4_pool({"strategy": "BLUE_GREEN"})) == [
        f"GPU node pool ({L4}) upgrades BLUE_GREEN: a second pool of GPUs during every upgrade. {FIX}"
    ]
    assert rule(NODE_POOL, l4_pool({"strategy": None, "maxSurge": 0, "maxUnavailable": 1})) == []
    assert rule(NODE_POOL, l4_pool({"strategy": "", "maxSurge": 0, "maxUnavailable": 1})) == []


@pytest.mark.parametrize(
    "resource_type, props",
    [
        (CLUSTER, l4_pool()),
        (INSTANCE, {"machineType": "g2-standard-8"}),
        (NODE_POOL, {}),
        (NODE_POOL, {"nodeConfig": UNKNOWN_OBJECT}),
        (NODE_POOL, {"nodeConfig": {}}),  # e2-medium by default: no GPU
        (NODE_POOL, {"nodeConfig": {"machineType": UNKNOWN_STRING}}),
        (NODE_POOL, l4_pool(UNKNOWN_OBJECT)),
        (NODE_POOL, l4_pool({"strategy": UNKNOWN_STRING})),
        (NODE_POOL, l4_pool({"maxSurge": UNKNOWN_NUMBER, "maxUnavailable": 1})),
        (NODE_POOL, l4_pool({"maxSurge": 0, "maxUnavailable": UNKNOWN_NUMBER})),
    ],
)
def test_upgrade_passes_what_it_cannot_know_and_what_it_does_not_police(resource_type, props):
    """Kills ``resource_type != NODE_POOL`` -> ``==``, ``if not configs`` negated, ``evidence is None or
    evidence is UNKNOWN`` -> ``and``, ``is_unknown(settings)`` negated and ``any`` -> ``all``."""
    assert gpu_node_pool_upgrade_needs_no_extra_gpu(resource_type, props) == []


def test_upgrade_judges_attached_gpus_too():
    """Kills ``configs[0]`` -> ``configs[1]`` and the evidence read from the wrong config: an N1 pool with
    a T4 attached is judged, named by its accelerator."""
    props = {"nodeConfig": {"machineType": "n1-standard-8", "guestAccelerators": T4}}
    assert gpu_node_pool_upgrade_needs_no_extra_gpu(NODE_POOL, props) == [
        "GPU node pool (guestAccelerators nvidia-tesla-t4) upgrades with maxSurge 1 and maxUnavailable 0: "
        f"each surge node is one more GPU in the zone. {FIX}"
    ]


# ------------------------------------------------------------------------------------------------------
# backend_timeout_fits_websockets
# ------------------------------------------------------------------------------------------------------

TIMEOUT = (
    "timeoutSec {now}: the load balancer closes a WebSocket after the backend timeout. Set timeoutSec to at "
    "least 600 s, and past the longest session (Python: timeout_sec=max_session_s + 60)."
)


def test_backend_timeout_boundary_and_message():
    """Kills ``timeout >= MIN`` -> ``>``, ``MIN_WEBSOCKET_BACKEND_TIMEOUT_S`` 600 -> 601/599, ``and`` ->
    ``or`` in the pass condition, ``not isinstance(timeout, bool)`` negated, ``timeout is None`` -> ``is not
    None`` in the message, and the texts."""
    rule = backend_timeout_fits_websockets
    assert rule(BACKEND_SERVICE, {"timeoutSec": 600.0}) == []
    assert rule(BACKEND_SERVICE, {"timeoutSec": 600, "protocol": "HTTP"}) == []
    assert rule(BACKEND_SERVICE, {"timeoutSec": 599.0}) == [TIMEOUT.format(now="is 599.0 s")]
    assert rule(BACKEND_SERVICE, {}) == [TIMEOUT.format(now="is not set (default 30 s)")]
    assert rule(BACKEND_SERVICE, {"timeoutSec": True}) == [TIMEOUT.format(now="is True s")]
    assert rule(BACKEND_SERVICE, {"timeoutSec": "3600"}) == [TIMEOUT.format(now='is "3600" s')]


@pytest.mark.parametrize("protocol", ["HTTP", "https", "HTTP2", None])
def test_backend_timeout_polices_http_protocols(protocol):
    """Kills each protocol name in ``("HTTP", "HTTPS", "HTTP2")`` changed, ``.upper()`` -> ``.lower()``,
    ``protocol is not None and`` -> ``or`` (a missing protocol is HTTP)."""
    props = {"timeoutSec": 30.0} if protocol is None else {"timeoutSec": 30.0, "protocol": protocol}
    assert backend_timeout_fits_websockets(BACKEND_SERVICE, props) == [TIMEOUT.format(now="is 30.0 s")]


@pytest.mark.parametrize(
    "resource_type, props",
    [
        (BACKEND_SERVICE, {"protocol": "TCP", "timeoutSec": 30.0}),
        (BACKEND_SERVICE, {"protocol": "GRPC"}),
        (BACKEND_SERVICE, {"protocol": UNKNOWN_STRING, "timeoutSec": 30.0}),
        (BACKEND_SERVICE, {"timeoutSec": UNKNOWN_NUMBER}),
        (INSTANCE, {"timeoutSec": 30.0}),
    ],
)
def test_backend_timeout_passes_other_protocols_unknowns_and_other_types(resource_type, props):
    """Kills ``resource_type != BACKEND_SERVICE`` -> ``==``, ``not in`` -> ``in`` on the protocol, and the
    unknown protocol or timeout judged."""
    assert backend_timeout_fits_websockets(resource_type, props) == []


# ------------------------------------------------------------------------------------------------------
# session_affinity_needs_hash_policy
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["MAGLEV", "WEIGHTED_MAGLEV", "RING_HASH", "ring_hash"])
def test_affinity_with_a_hashing_policy_passes(policy):
    """Kills each name of ``HASH_LOCALITY_POLICIES`` changed, ``.upper()`` -> ``.lower()`` and ``in`` ->
    ``not in``."""
    props = {"sessionAffinity": "HEADER_FIELD", "localityLbPolicy": policy}
    assert session_affinity_needs_hash_policy(BACKEND_SERVICE, props) == []


def test_affinity_without_a_hashing_policy_is_refused_by_name():
    """Kills ``policy is None`` -> ``is not None`` in the message, the ``" or "`` join and the texts."""
    rule = session_affinity_needs_hash_policy
    tail = " Use MAGLEV or WEIGHTED_MAGLEV or RING_HASH, or drop the affinity."
    assert rule(BACKEND_SERVICE, {"sessionAffinity": "CLIENT_IP"}) == [
        'sessionAffinity "CLIENT_IP" has no effect: localityLbPolicy is not set (ROUND_ROBIN).' + tail
    ]
    assert rule(BACKEND_SERVICE, {"sessionAffinity": "CLIENT_IP", "localityLbPolicy": "LEAST_REQUEST"}) == [
        'sessionAffinity "CLIENT_IP" has no effect: localityLbPolicy is "LEAST_REQUEST".' + tail
    ]
    assert rule(BACKEND_SERVICE, {"sessionAffinity": "CLIENT_IP", "localityLbPolicy": 3}) == [
        'sessionAffinity "CLIENT_IP" has no effect: localityLbPolicy is 3.' + tail
    ]


@pytest.mark.parametrize(
    "resource_type, props",
    [
        (BACKEND_SERVICE, {}),
        (BACKEND_SERVICE, {"sessionAffinity": "NONE"}),
        (BACKEND_SERVICE, {"sessionAffinity": "NONE", "localityLbPolicy": "ROUND_ROBIN"}),
        (BACKEND_SERVICE, {"sessionAffinity": UNKNOWN_STRING}),
        (BACKEND_SERVICE, {"sessionAffinity": "CLIENT_IP", "localityLbPolicy": UNKNOWN_STRING}),
        (INSTANCE, {"sessionAffinity": "CLIENT_IP"}),
    ],
)
def test_affinity_passes_none_unknowns_and_other_types(resource_type, props):
    """Kills ``affinity in (None, "NONE")`` changed (``"NONE"`` renamed, ``not in``), the unknowns judged
    (``or`` -> ``and``) and ``resource_type != BACKEND_SERVICE`` -> ``==``."""
    assert session_affinity_needs_hash_policy(resource_type, props) == []


# ------------------------------------------------------------------------------------------------------
# https_proxy_tls_1_2
# ------------------------------------------------------------------------------------------------------

NO_POLICY = (
    "target HTTPS proxy without sslPolicy: Google's default policy accepts TLS 1.0 and 1.1. Set sslPolicy "
    'to a compute.SSLPolicy with min_tls_version "TLS_1_2".'
)


def test_https_proxy_needs_an_ssl_policy():
    """Kills ``policy is None or policy == ""`` -> ``and``/``!= ""``/``== "XXXX"``, ``resource_type ==
    TARGET_HTTPS_PROXY`` -> ``!=``, and the message."""
    assert https_proxy_tls_1_2(TARGET_HTTPS_PROXY, {}) == [NO_POLICY]
    assert https_proxy_tls_1_2(TARGET_HTTPS_PROXY, {"sslPolicy": ""}) == [NO_POLICY]
    assert (
        https_proxy_tls_1_2(TARGET_HTTPS_PROXY, {"sslPolicy": "projects/p/global/sslPolicies/modern"}) == []
    )
    assert https_proxy_tls_1_2(TARGET_HTTPS_PROXY, {"sslPolicy": UNKNOWN_STRING}) == []
    assert https_proxy_tls_1_2(INSTANCE, {}) == []


@pytest.mark.parametrize(
    "version, now",
    [(None, "is not set (TLS_1_0)"), ("TLS_1_0", "is TLS_1_0"), ("TLS_1_1", "is TLS_1_1")],
)
def test_ssl_policy_before_tls_1_2_is_refused(version, now):
    """Kills ``version is None or version in OLD_TLS_VERSIONS`` -> ``and``/``not in``, each old version's
    name changed, ``version is None`` -> ``is not None`` in the message, and its texts."""
    props = {} if version is None else {"minTlsVersion": version}
    assert https_proxy_tls_1_2(SSL_POLICY, props) == [
        f'SSL policy minTlsVersion {now}: clients may use TLS 1.0/1.1. Set min_tls_version "TLS_1_2".'
    ]


@pytest.mark.parametrize(
    "props", [{"minTlsVersion": "TLS_1_2"}, {"minTlsVersion": "TLS_1_3"}, {"minTlsVersion": UNKNOWN_STRING}]
)
def test_ssl_policy_from_tls_1_2_passes(props):
    """Kills ``resource_type == SSL_POLICY`` and the unknown version judged (``is_unknown`` negated)."""
    assert https_proxy_tls_1_2(SSL_POLICY, props) == []


# ------------------------------------------------------------------------------------------------------
# Survivors of the first rerun in the other rules and helpers
# ------------------------------------------------------------------------------------------------------


def test_unknown_reads_as_such():
    """Kills ``_Unknown.__repr__``'s text (no selected test printed it): what an operator sees in a
    message that names an unknown value."""
    assert repr(UNKNOWN) == "<unknown during preview>"


def test_check_resources_hands_names_inputs_and_dependencies_to_the_stack_rules():
    """Kills ``check_resources``' stack: ``deps = item[3] if len(item) > 3`` (dropped, ``item[4]``, ``> 4``),
    ``tuple(deps)`` (-> None), and each ``StackResource`` field dropped or None: a Service and a resource
    that waits for it, given as quadruples, pass; the same resource without the dependency is named."""
    service_props = {"service": "compute.googleapis.com"}
    vm_props = {"machineType": "e2-standard-4"}
    assert (
        check_resources(
            [(SERVICE, service_props, "api-compute", []), (INSTANCE, vm_props, "vm", ["api-compute"])]
        )
        == []
    )
    assert check_resources([(SERVICE, service_props, "api-compute", []), (INSTANCE, vm_props, "vm", [])]) == [
        f"[apis-enabled-for-features] {INSTANCE} vm needs compute.googleapis.com (gcp:compute/ resources) "
        "but does not depend on its enablement (api-compute): pass the APIs' ResourceOptions (depends_on)."
    ]
    pool = {"nodeConfig": {"gcfsConfig": {"enabled": True}}}
    assert check_resources([(SERVICE, service_props, "api-compute"), (NODE_POOL, pool, "pool")]) == [
        f"[apis-enabled-for-features] {NODE_POOL} pool needs container.googleapis.com (gcp:container/ "
        "resources), which the stack does not enable: add it to the APIs the program enables.",
        f"[apis-enabled-for-features] {NODE_POOL} pool needs containerfilesystem.googleapis.com (image "
        "streaming (nodeConfig.gcfsConfig)), which the stack does not enable: add it to the APIs the program "
        "enables.",
    ]


def test_apis_walk_past_a_dependency_outside_the_stack():
    """Kills ``waits_for``'s ``continue`` -> ``break`` for a dependency outside the stack: the walk goes on
    to the resource's other dependencies."""
    compute = service("compute.googleapis.com", "api-compute")
    node = StackResource(
        INSTANCE, {}, "node", ("api-compute", "urn:pulumi:dev::x::random:index:RandomId::id")
    )
    assert apis_enabled_for_features([compute, node]) == []


def fw(ports: list[Any], sources: list[str]) -> dict[str, Any]:
    return {"direction": "INGRESS", "allows": [{"protocol": "tcp", "ports": ports}], "sourceRanges": sources}


def test_firewall_messages_name_the_allow_block():
    """Kills ``opening.where.split('.')[0]`` (-> ``split(None)``, ``'XX.XX'``) in both firewall rules, and
    the monitoring rule's two kinds of source (``"public range"``, ``"source that is not a CIDR range"``,
    ``network is not None`` negated)."""
    assert firewall_no_world_ssh(FIREWALL, fw(["80", "20-30"], ["0.0.0.0/0"])) == [
        'INGRESS rule opens SSH (tcp/22) via allows[0].ports[1] "20-30" to 0.0.0.0/0 (sourceRanges[0]). '
        "Restrict sourceRanges to IAP's 35.235.240.0/20 (gcloud compute ssh --tunnel-through-iap) or a "
        "private/VPN range, or drop port 22 from allows[0]."
    ]
    tail = (
        "Monitoring stays private: limit sourceRanges to 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16 or IAP's "
        "35.235.240.0/20 (or reach it through an SSH/IAP tunnel), or take tcp/9090 out of allows[0]."
    )
    assert firewall_no_public_monitoring(FIREWALL, fw(["9090"], ["8.8.8.0/24", "my-tag"])) == [
        'INGRESS rule opens Prometheus (tcp/9090) via allows[0].ports[0] "9090" to public range 8.8.8.0/24 '
        f"(sourceRanges[0]). {tail}",
        'INGRESS rule opens Prometheus (tcp/9090) via allows[0].ports[0] "9090" to source that is not a CIDR '
        f"range my-tag (sourceRanges[1]). {tail}",
    ]


def test_an_inverted_port_range_is_unreadable():
    """Kills ``_port_range``'s ``(low, high) if low <= high else None`` -> ``or True``: "9095-9090" is no
    range; the monitoring rule refuses it as unreadable rather than passing it."""
    assert firewall_no_public_monitoring(FIREWALL, fw(["9095-9090"], ["0.0.0.0/0"])) == [
        'allows[0].ports[0] = "9095-9090" is not a port or a port range ("3000", "3000-3100") and this rule '
        "is open to 0.0.0.0/0; write the port as a number or a low-high range."
    ]


def test_maintenance_message_when_unset():
    """Kills ``gpu_instance_terminates_on_maintenance``'s "is not set" text (changed, lower-cased)."""
    assert gpu_instance_terminates_on_maintenance(INSTANCE, {"machineType": "a2-ultragpu-1g"}) == [
        "GPU instance (machineType a2-ultragpu-1g, whose GPU is built in): scheduling.onHostMaintenance is "
        "not set (GCE defaults to MIGRATE). GPU VMs cannot live-migrate; set scheduling.onHostMaintenance = "
        '"TERMINATE" (Python: scheduling={"on_host_maintenance": "TERMINATE", "automatic_restart": True}).'
    ]


GPU_TAINT_OK = {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}


def l4_config(*taints: Any) -> dict[str, Any]:
    return {"machineType": "g2-standard-8", "taints": list(taints)}


@pytest.mark.parametrize(
    "default_pool",
    [
        {"machineType": "e2-standard-4"},  # no GPU: skipped (continue, not break)
        l4_config(GPU_TAINT_OK),  # tainted: passes, the next pool is still judged
        {"machineType": "g2-standard-8", "taints": UNKNOWN_STRING},  # taints unknown: skipped
    ],
)
def test_taint_rule_judges_every_pool_of_a_cluster(default_pool):
    """Kills ``gpu_node_pool_tainted``'s ``continue`` -> ``break`` after a pool without a GPU, with
    unknown taints, or that passes: the cluster's next pool (inline ``nodePools[0]``) is judged."""
    props = {"nodeConfig": default_pool, "nodePools": [{"nodeConfig": l4_config()}]}
    messages = gpu_node_pool_tainted(CLUSTER, props)
    assert len(messages) == 1 and messages[0].startswith(
        "GPU node pool (nodePools[0].nodeConfig.machineType g2-standard-8, whose GPU is built in) has no "
        'nodePools[0].nodeConfig.taints entry with key "nvidia.com/gpu" and effect "NO_SCHEDULE".'
    )


def test_taint_rule_reads_each_taint():
    """Kills ``gpu_node_pool_tainted``'s taint loop: a taint unknown as a whole leaves the pool undecided
    (``undecided = None``, ``or`` -> ``and``, ``is UNKNOWN`` -> ``is not``), a malformed one is skipped,
    not the end of the list (``continue`` -> ``break``), and an unknown effect leaves it undecided
    (``is_unknown(effect)`` -> ``is_unknown(None)``)."""
    pool = lambda *taints: {"nodeConfig": l4_config(*taints)}  # noqa: E731
    assert gpu_node_pool_tainted(NODE_POOL, pool(UNKNOWN_OBJECT)) == []
    assert gpu_node_pool_tainted(NODE_POOL, pool("junk", GPU_TAINT_OK)) == []
    assert len(gpu_node_pool_tainted(NODE_POOL, pool("junk"))) == 1
    assert gpu_node_pool_tainted(NODE_POOL, pool({"key": "nvidia.com/gpu", "effect": UNKNOWN_STRING})) == []


def test_machine_type_rule_messages_and_every_accelerator():
    """Kills ``machine_type_carries_gpu``: the unset machine type's message (``None``, ``_q(None)``) and
    ``continue`` -> ``break`` after it, after an unknown accelerator (with the catalog's list: ``", "``)
    and after an unknown entry; ``_gpu_homes`` (the ``-*`` family of each type carrying the GPU:
    ``rsplit("-", 1)[0]`` changed, ``m.gpu == gpu`` negated, ``" types"``, the T4 case forced)."""
    two = [{"type": "nvidia-tesla-t4", "count": 1.0}, {"type": "nvidia-l4", "count": 1.0}]
    assert machine_type_carries_gpu(INSTANCE, {"guestAccelerators": two}) == [
        'guestAccelerators[0] attaches "nvidia-tesla-t4" but machineType is not set; set it.',
        'guestAccelerators[1] attaches "nvidia-l4" but machineType is not set; set it.',
    ]
    l4 = {"machineType": "zz-standard-8", "guestAccelerators": [{"type": "nvidia-l4", "count": 1.0}]}
    assert machine_type_carries_gpu(INSTANCE, l4) == [
        'machineType "zz-standard-8" cannot carry guestAccelerators[0] (1 x nvidia-l4): zz-standard-8 cannot '
        'carry l4: on GCP L4 comes only with g2-standard-* types; use machineType "g2-standard-8".'
    ]
    a100 = {"machineType": "zz-standard-8", "guestAccelerators": [{"type": "nvidia-a100-80gb", "count": 1.0}]}
    assert machine_type_carries_gpu(INSTANCE, a100) == [
        'machineType "zz-standard-8" cannot carry guestAccelerators[0] (1 x nvidia-a100-80gb): zz-standard-8 '
        "cannot carry a100-80gb-sxm: on GCP A100 80 GB comes only with a2-ultragpu-* types; use machineType "
        '"a2-ultragpu-1g".'
    ]
    unknown_first = [{"type": "nvidia-tesla-v100", "count": 1.0}, {"type": "nvidia-tesla-a100", "count": 1.0}]
    assert machine_type_carries_gpu(
        INSTANCE, {"machineType": "n1-standard-8", "guestAccelerators": unknown_first}
    ) == [
        'guestAccelerators[0].type "nvidia-tesla-v100" is not in the capacity planner\'s GCP catalog '
        "(infra/capacity/gcp.py knows nvidia-a100-80gb, nvidia-h100-80gb, nvidia-h200-141gb, nvidia-l4, "
        "nvidia-tesla-a100, nvidia-tesla-t4); use one of those or add it to the catalog.",
        'machineType "n1-standard-8" cannot carry guestAccelerators[1] (1 x nvidia-tesla-a100): '
        "n1-standard-8 (N1) cannot carry a100-40gb: on GCP A100 40 GB comes only with a2-highgpu-* types; "
        'use machineType "a2-highgpu-1g".',
    ]
    unknown_entry = [UNKNOWN_OBJECT, {"type": "nvidia-tesla-a100", "count": 1.0}]
    assert (
        len(
            machine_type_carries_gpu(
                INSTANCE, {"machineType": "n1-standard-8", "guestAccelerators": unknown_entry}
            )
        )
        == 1
    )


@pytest.mark.parametrize(
    "default_pool",
    [{"machineType": "e2-standard-4"}, {"machineType": UNKNOWN_STRING, "guestAccelerators": T4}],
)
def test_machine_type_rule_judges_every_pool_of_a_cluster(default_pool):
    """Kills ``machine_type_carries_gpu``'s ``continue`` -> ``break`` after a pool without accelerators
    and after one whose machine type is unknown: the next pool is judged."""
    bad = {"machineType": "g2-standard-8", "guestAccelerators": [{"type": "nvidia-tesla-t4", "count": 1.0}]}
    props = {"nodeConfig": default_pool, "nodePools": [{"nodeConfig": bad}]}
    messages = machine_type_carries_gpu(CLUSTER, props)
    assert len(messages) == 1 and messages[0].startswith(
        'nodePools[0].nodeConfig.machineType "g2-standard-8" cannot carry nodePools[0].nodeConfig.'
        "guestAccelerators[0] (1 x nvidia-tesla-t4)"
    )


# ------------------------------------------------------------------------------------------------------
# Survivors of the second rerun (the helpers every rule reads through)
# ------------------------------------------------------------------------------------------------------


def test_a_nested_object_that_is_not_one_counts_as_missing():
    """Kills ``_obj``'s ``isinstance(value, dict) or True`` (a string taken for the object) and
    ``_gpu_configs``' ``isinstance(pool, dict) or True`` (a malformed inline pool read as one)."""
    assert gpu_instance_terminates_on_maintenance(INSTANCE, t4_vm("junk")) == [
        "GPU instance (guestAccelerators nvidia-tesla-t4): scheduling.onHostMaintenance is not set (GCE "
        'defaults to MIGRATE). GPU VMs cannot live-migrate; set scheduling.onHostMaintenance = "TERMINATE" '
        '(Python: scheduling={"on_host_maintenance": "TERMINATE", "automatic_restart": True}).'
    ]
    assert gpu_node_pool_tainted(CLUSTER, {"nodePools": ["junk", {"nodeConfig": l4_config()}]}) != []


def test_every_accelerator_entry_is_read():
    """Kills ``_accelerators``' ``continue`` -> ``break`` after a malformed entry and after a zero count,
    ``_gpu_evidence``'s ``isinstance(acc, dict) or True``, its unknown accelerator's text (``"an unknown
    accelerator"`` changed, ``is_unknown(kind)`` -> ``is_unknown(None)`` or ``and False``) and the ``", "``
    join of several; ``machine_type_carries_gpu``'s ``continue`` -> ``break`` after an unknown type."""
    junk_first = {"machineType": "n1-standard-8", "guestAccelerators": ["junk", T4[0]]}
    assert gpu_instance_terminates_on_maintenance(INSTANCE, junk_first)[0].startswith(
        "GPU instance (guestAccelerators nvidia-tesla-t4): "
    )
    zero_first = {"machineType": "n1-standard-8", "guestAccelerators": [{**T4[0], "count": 0.0}, T4[0]]}
    assert gpu_instance_terminates_on_maintenance(INSTANCE, zero_first)[0].startswith(
        "GPU instance (guestAccelerators nvidia-tesla-t4): "
    )
    mixed = {
        "machineType": "n1-standard-8",
        "guestAccelerators": [UNKNOWN_OBJECT, {"type": UNKNOWN_STRING}, T4[0]],
    }
    assert gpu_instance_terminates_on_maintenance(INSTANCE, mixed)[0].startswith(
        "GPU instance (guestAccelerators an unknown accelerator, an unknown accelerator, nvidia-tesla-t4): "
    )
    unknown_type = [{"type": UNKNOWN_STRING}, {"type": "nvidia-tesla-a100", "count": 1.0}]
    assert (
        len(
            machine_type_carries_gpu(
                INSTANCE, {"machineType": "n1-standard-8", "guestAccelerators": unknown_type}
            )
        )
        == 1
    )


def test_firewall_reads_every_allow_block_and_names_the_default_source():
    """Kills ``_tcp_openings``' ``continue`` -> ``break`` after each block it skips (malformed, unknown or
    non-TCP protocol, unknown ports, a whole-range block, an unknown port), ``is_unknown(protocol) or not
    isinstance(protocol, str)`` -> ``and`` (a numeric protocol), protocol ``"all"`` (renamed: its ports are
    then read as if TCP) and its text; ``_ingress_sources``' default source text and ``strict=False`` ->
    ``True``/left out (a range with host bits set is still a range)."""
    ssh = {"protocol": "tcp", "ports": ["22"]}
    for skipped in (
        "junk",
        {"protocol": UNKNOWN_STRING},
        {"protocol": 6},
        {"protocol": "udp", "ports": ["22"]},
        {"protocol": "tcp", "ports": UNKNOWN_STRING},
        {"protocol": "tcp", "ports": [UNKNOWN_STRING, "22"]},
        {"protocol": "tcp", "ports": ["80"]},
    ):
        props = {"direction": "INGRESS", "allows": [skipped, ssh], "sourceRanges": ["0.0.0.0/0"]}
        assert any(
            "opens SSH (tcp/22) via allows[1].ports" in m for m in firewall_no_world_ssh(FIREWALL, props)
        )
    whole = {"direction": "INGRESS", "allows": [{"protocol": "all", "ports": ["80"]}, ssh]}
    assert [m.split(" to ")[0] for m in firewall_no_world_ssh(FIREWALL, whole)] == [
        'INGRESS rule opens SSH (tcp/22) via allows[0] protocol "all" (every port)',
        'INGRESS rule opens SSH (tcp/22) via allows[1].ports[0] "22"',
    ]
    bare = {"direction": "INGRESS", "allows": [{"protocol": "tcp"}]}
    assert firewall_no_world_ssh(FIREWALL, bare) == [
        'INGRESS rule opens SSH (tcp/22) via allows[0] protocol "tcp" without ports (every port) to '
        "0.0.0.0/0 (the default source: the rule sets no sourceRanges, sourceTags or sourceServiceAccounts). "
        "Restrict sourceRanges to IAP's 35.235.240.0/20 (gcloud compute ssh --tunnel-through-iap) or a "
        "private/VPN range, or drop port 22 from allows[0]."
    ]
    host_bits = {
        "direction": "INGRESS",
        "allows": [{"protocol": "tcp", "ports": ["9090"]}],
        "sourceRanges": ["10.1.2.3/8"],
    }
    assert firewall_no_public_monitoring(FIREWALL, host_bits) == []


def test_an_unreadable_port_does_not_hide_the_next():
    """Kills ``_tcp_openings``' ``continue`` -> ``break`` after an unreadable port spec: port 22 listed
    after it is still an opening."""
    props = {"direction": "INGRESS", "allows": [{"protocol": "tcp", "ports": ["ssh", "22"]}]}
    assert [m.split(" to ")[0] for m in firewall_no_world_ssh(FIREWALL, props)] == [
        'INGRESS rule opens SSH (tcp/22) via allows[0].ports[1] "22"'
    ]
