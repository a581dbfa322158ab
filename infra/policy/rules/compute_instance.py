"""Rules on ``gcp:compute/instance:Instance`` and ``gcp:compute/instanceTemplate:InstanceTemplate``:
GPU VMs terminate on host maintenance and shut down gracefully; the provisioning model is one GCE
sells for the machine type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.capacity.gcp import (
    PROVISIONING_MODELS,
    STOP_TIMEOUT_METADATA_KEY,
)
from infra.policy.rules._common import (
    INSTANCE,
    INSTANCE_TEMPLATE,
    UNKNOWN,
    _normalize,
    _obj,
    _q,
    _Unknown,
    is_unknown,
)
from infra.policy.rules._gpus import (
    _catalog_entry,
    _gpu_evidence,
)

# --------------------------------------------------------------------------------------------------------
# Rule 1: GPU instances terminate on host maintenance
# --------------------------------------------------------------------------------------------------------


def _gpu_instance_scheduling(
    resource_type: str, props: Mapping[str, Any]
) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """``(GPU evidence, normalised props, scheduling block or {})`` of a GPU instance or template, or None
    when the rules on GPU VMs do not apply: another resource type, no GPU, or the GPU evidence or
    ``scheduling`` unknown during preview."""
    if resource_type not in (INSTANCE, INSTANCE_TEMPLATE):
        return None
    p = _normalize(props)
    evidence = _gpu_evidence(p)
    if evidence is None or evidence is UNKNOWN:
        return None
    scheduling = _obj(p.get("scheduling"))
    if isinstance(scheduling, _Unknown):
        return None
    return str(evidence), p, scheduling or {}


def gpu_instance_terminates_on_maintenance(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A GPU VM (``guestAccelerators`` non-empty, or an A2/A3/A4/G2/G4 machine type whose GPU is built in)
    must set ``scheduling.onHostMaintenance`` to ``"TERMINATE"``: VMs with GPUs cannot live-migrate, and
    the default (MIGRATE) is refused by GCE or leaves the intent implicit.

    Polices ``gcp:compute/instance:Instance`` and ``gcp:compute/instanceTemplate:InstanceTemplate``.
    Passes when the value it needs is unknown during preview: ``scheduling`` or ``onHostMaintenance``
    unknown, or whether the VM has a GPU unknown (``guestAccelerators`` and ``machineType`` both unknown or
    not GPU). A missing ``scheduling`` / ``onHostMaintenance`` is a violation (GCE's default is MIGRATE).
    """
    gpu = _gpu_instance_scheduling(resource_type, props)
    if gpu is None:
        return []
    evidence, _, scheduling = gpu
    value = scheduling.get("onHostMaintenance")
    if is_unknown(value):
        return []
    if isinstance(value, str) and value.upper() == "TERMINATE":
        return []
    now = "is not set (GCE defaults to MIGRATE)" if value is None else f"is {_q(value)}"
    return [
        f"GPU instance ({evidence}): scheduling.onHostMaintenance {now}. GPU VMs cannot live-migrate; "
        f'set scheduling.onHostMaintenance = "TERMINATE" '
        f'(Python: scheduling={{"on_host_maintenance": "TERMINATE", "automatic_restart": True}}).'
    ]


# --------------------------------------------------------------------------------------------------------
# Rule 8: GPU VMs shut down gracefully for as long as the node's drain
# --------------------------------------------------------------------------------------------------------

MIN_GRACEFUL_SHUTDOWN_S = 60
"""The shortest graceful shutdown allowed on a GPU VM without the node's own figure in its metadata."""


def gpu_instance_graceful_shutdown(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A GPU VM enables GCE graceful shutdown (``scheduling.gracefulShutdown.enabled``) for at least the
    seconds its metadata key ``duplexops-stop-timeout-s`` names (else ``MIN_GRACEFUL_SHUTDOWN_S``).
    GCE's default gives the guest only seconds on stop, delete or replace, which cuts every live
    conversation (cloud.google.com/compute/docs/instances/graceful-shutdown-overview); the maximum is
    3600 s (pulumi-gcp 10.2 ``InstanceSchedulingGracefulShutdownMaxDurationArgs``). A VM with a limited run
    time (``maxRunDuration`` or ``terminationTime``: Flex-start) must *not* enable it: GCE excludes graceful
    shutdown for such VMs (graceful-shutdown-overview, limitations; FIELD-NOTES third round).

    Polices instances and instance templates; passes when the GPU evidence, ``scheduling``,
    ``gracefulShutdown`` or the duration is unknown during preview."""
    gpu = _gpu_instance_scheduling(resource_type, props)
    if gpu is None:
        return []
    evidence, p, scheduling = gpu
    graceful = _obj(scheduling.get("gracefulShutdown"))
    if isinstance(graceful, _Unknown):
        return []
    limited = [k for k in ("maxRunDuration", "terminationTime") if scheduling.get(k)]
    if str(scheduling.get("provisioningModel", "")).upper() == "FLEX_START" or limited:
        if isinstance(graceful, dict) and graceful.get("enabled") is True:
            why = ", ".join(f"scheduling.{k}" for k in limited) or "FLEX_START"
            return [
                f"GPU instance ({evidence}) has a limited run time ({why}): GCE excludes graceful shutdown "
                "for it; remove scheduling.gracefulShutdown."
            ]
        return []
    metadata = _obj(p.get("metadata"))
    needed = MIN_GRACEFUL_SHUTDOWN_S
    if isinstance(metadata, dict):
        raw = metadata.get(STOP_TIMEOUT_METADATA_KEY)
        if is_unknown(raw):
            return []
        if raw is not None and str(raw).isdigit():
            needed = int(str(raw))
    enabled = None if graceful is None else graceful.get("enabled")
    duration = _obj((graceful or {}).get("maxDuration"))
    if is_unknown(enabled) or isinstance(duration, _Unknown):
        return []
    seconds = None if duration is None else duration.get("seconds")
    if is_unknown(seconds):
        return []
    if enabled is True and isinstance(seconds, (int, float)) and seconds >= needed:
        return []
    now = (
        "is not enabled (GCE gives the guest only seconds)"
        if enabled is not True
        else f"lasts {_q(seconds)} s, less than the {needed} s the node needs to drain"
    )
    return [
        f"GPU instance ({evidence}): scheduling.gracefulShutdown {now}. Live conversations are cut on "
        f"stop, delete or replace; set gracefulShutdown = {{enabled: true, maxDuration: {{seconds: "
        f"{needed}}}}} (at most 3600)."
    ]


# --------------------------------------------------------------------------------------------------------
# Rule 9: the provisioning model is one GCE sells for the machine type
# --------------------------------------------------------------------------------------------------------

_MODEL_KEYS = {gce: key for key, gce in PROVISIONING_MODELS.items()}


def provisioning_model_sold(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A VM's ``scheduling.provisioningModel`` (STANDARD when unset) is one GCE sells its machine type as
    (capacity catalog ``sold_as``: a3-highgpu-1g/2g/4g are Spot or Flex-start only,
    cloud.google.com/compute/docs/accelerator-optimized-machines#a3-high-vms), with the settings the model
    requires (pulumi-gcp 10.2 ``provisioning_model`` docstring): SPOT needs ``preemptible`` true and
    ``automaticRestart`` false; FLEX_START needs ``automaticRestart`` false, ``instanceTerminationAction``
    DELETE, a ``maxRunDuration`` and ``reservationAffinity.type`` NO_RESERVATION (Flex-start never consumes
    a reservation: ``--reservation-affinity=none`` in cloud.google.com/compute/docs/instances/
    create-flex-start-vm).

    Polices instances; passes for machine types outside the catalog and for unknown values."""
    if resource_type != INSTANCE:
        return []
    p = _normalize(props)
    machine_type = p.get("machineType")
    scheduling = _obj(p.get("scheduling"))
    if is_unknown(machine_type) or isinstance(scheduling, _Unknown) or not isinstance(machine_type, str):
        return []
    scheduling = scheduling or {}
    if any(is_unknown(v) for v in scheduling.values()):
        return []
    model = scheduling.get("provisioningModel") or "STANDARD"
    problems = []
    entry = _catalog_entry(machine_type)
    key = _MODEL_KEYS.get(str(model).upper())
    if key is None:
        problems.append(
            f"scheduling.provisioningModel {_q(model)} is not one of "
            f"{', '.join(PROVISIONING_MODELS.values())}"
        )
    elif entry is not None and key not in entry.sold_as:
        sold = " or ".join(PROVISIONING_MODELS[m] for m in entry.sold_as)
        problems.append(
            f"machine type {_q(entry.name)} is sold only as {sold}, not {_q(model)}: GCE refuses to create "
            "the VM. Set scheduling.provisioningModel accordingly (stack config duplexops:provisioningModel)."
        )
    if key == "spot" and (scheduling.get("preemptible") is not True or scheduling.get("automaticRestart")):
        problems.append("SPOT needs scheduling.preemptible = true and scheduling.automaticRestart = false")
    if key == "flex-start" and (
        scheduling.get("automaticRestart")
        or str(scheduling.get("instanceTerminationAction", "")).upper() != "DELETE"
        or not scheduling.get("maxRunDuration")
    ):
        problems.append(
            "FLEX_START needs scheduling.automaticRestart = false, instanceTerminationAction = DELETE and a "
            "maxRunDuration"
        )
    affinity = _obj(p.get("reservationAffinity"))
    if key == "flex-start" and not isinstance(affinity, _Unknown):
        kind = (affinity or {}).get("type")
        if not is_unknown(kind) and str(kind).upper() != "NO_RESERVATION":
            problems.append(
                f"FLEX_START needs reservationAffinity = {{type: NO_RESERVATION}} (now {_q(kind)}): a "
                "Flex-start VM does not consume reservations"
            )
    return problems
