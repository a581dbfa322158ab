"""GCP machine types that carry GPUs, and their on-demand prices.

Rules (cloud.google.com/compute/docs/gpus, summarised in the project's field notes):
- T4 is attached to N1 machine types only (1, 2 or 4 per VM); an N1 type cannot take an A100, L4 or H100.
- L4 comes with G2 types, A100 40 GB with ``a2-highgpu-*``, A100 80 GB with ``a2-ultragpu-*``, H100 80 GB
  with ``a3-highgpu-*``, H200 with ``a3-ultragpu-*``: on A2, G2 and A3 the GPU count is fixed by the type.
- No L40S on GCP (on-premises only), and no A100 80 GB PCIe (a2-ultragpu carries the SXM part).

Prices are on-demand, us-central1, USD per hour for the whole VM (vCPUs, memory and GPUs), each with its
source and the date it was read. Where the field notes give a figure it is used; the others were read from
cloud.google.com/compute/gpus-pricing and /vm-instance-pricing (2025 list prices, not re-read in 2026:
re-check before quoting them to anyone).
"""

from __future__ import annotations

from dataclasses import dataclass

from .units import check_choice


@dataclass(frozen=True)
class Price:
    """An hourly on-demand price (USD per hour) with where and when it was read."""

    usd_per_hour: float
    source: str
    read_on: str


@dataclass(frozen=True)
class MachineType:
    """A GCP machine type.

    Attributes:
        name: the type (``g2-standard-8``).
        family: N1, G2, A2, A3.
        vcpus: virtual CPUs.
        memory_gb: memory (GB as GCP quotes it).
        gpu: catalog key of the GPU the type carries (bundled) or accepts (attached, N1); None for none.
        gpu_count: GPUs bundled with the type; for N1 the counts that may be attached.
        bundled: True when the GPU comes with the type (A2, G2, A3), False when attached (N1).
        price: on-demand price of the VM with ``gpu_count[0]`` GPUs, or None when unknown.
        sold_as: the provisioning models GCE sells the type under (``PROVISIONING_MODELS`` keys); by
            default :func:`default_sold_as` of the family (Flex-start for accelerator-optimized families).
        bundled_local_ssd: True when GCE attaches Local SSD disks to every VM of the type by itself
            (A2 Ultra, A3: cloud.google.com/compute/docs/disks/add-local-ssd, "every machine type comes
            with Local SSD storage"); the provider reads them back as ``scratch_disk``.
    """

    name: str
    family: str
    vcpus: int
    memory_gb: float
    gpu: str | None
    gpu_count: tuple[int, ...]
    bundled: bool
    price: Price | None
    sold_as: tuple[str, ...] = ()
    bundled_local_ssd: bool = False

    def __post_init__(self) -> None:
        if not self.sold_as:
            object.__setattr__(self, "sold_as", default_sold_as(self.family))


FLEX_START_FAMILIES = frozenset({"A2", "A3", "A4", "G2"})
"""Machine families GCE sells as Flex-start: every accelerator-optimized family but A4X and G4 ("About
Flex-start VMs": "Flex-start VMs support all accelerator-optimized machine types (except A4X and G4) and
H4D machine types", cloud.google.com/compute/docs/instances/about-flex-start-vms, read November 2026). N1
with an attached T4 is general-purpose: Standard and Spot only."""


def default_sold_as(family: str) -> tuple[str, ...]:
    """The provisioning models GCE sells a type of ``family`` under, unless the type says otherwise
    (``MachineType.sold_as``): Standard and Spot, plus Flex-start for ``FLEX_START_FAMILIES``."""
    return ("standard", "spot", "flex-start") if family in FLEX_START_FAMILIES else ("standard", "spot")


_FN = "FIELD-NOTES 'GCP GPUs' (GCP billing catalog, us-central1)"
_FN_DATE = "2026-11"
_PAGE = "cloud.google.com/compute/vm-instance-pricing + gpus-pricing, us-central1 list price"
_PAGE_DATE = "2025 (not re-read)"

# N1 standard: 3.75 GB per vCPU (cloud.google.com/compute/docs/general-purpose-machines#n1_machines).
# n1-standard-N price: $0.0475 per vCPU-hour incl. memory (vm-instance-pricing, us-central1) + T4 $0.35/GPU-h
# (FIELD-NOTES). The price given is the VM with one T4 attached.
_T4_H = 0.35

MACHINE_TYPES: dict[str, MachineType] = {
    "n1-standard-4": MachineType(
        "n1-standard-4",
        "N1",
        4,
        15.0,
        "t4",
        (1, 2, 4),
        False,
        Price(round(4 * 0.0475 + _T4_H, 4), f"{_PAGE} (VM) + {_FN} (T4 $0.35/GPU-h)", _PAGE_DATE),
    ),
    "n1-standard-8": MachineType(
        "n1-standard-8",
        "N1",
        8,
        30.0,
        "t4",
        (1, 2, 4),
        False,
        Price(round(8 * 0.0475 + _T4_H, 4), f"{_PAGE} (VM) + {_FN} (T4 $0.35/GPU-h)", _PAGE_DATE),
    ),
    "n1-standard-16": MachineType(
        "n1-standard-16",
        "N1",
        16,
        60.0,
        "t4",
        (1, 2, 4),
        False,
        Price(round(16 * 0.0475 + _T4_H, 4), f"{_PAGE} (VM) + {_FN} (T4 $0.35/GPU-h)", _PAGE_DATE),
    ),
    # G2 (cloud.google.com/compute/docs/accelerator-optimized-machines#g2-vms): 1 L4 up to g2-standard-32.
    # Price: the whole-VM list price (it includes the L4, $0.56/GPU-h in FIELD-NOTES).
    "g2-standard-4": MachineType(
        "g2-standard-4", "G2", 4, 16.0, "l4", (1,), True, Price(0.7068, _PAGE, _PAGE_DATE)
    ),
    "g2-standard-8": MachineType(
        "g2-standard-8", "G2", 8, 32.0, "l4", (1,), True, Price(0.8536, _PAGE, _PAGE_DATE)
    ),
    "g2-standard-16": MachineType(
        "g2-standard-16", "G2", 16, 64.0, "l4", (1,), True, Price(1.1470, _PAGE, _PAGE_DATE)
    ),
    # A2 Standard (a2-highgpu-*): A100 40 GB SXM4, 12 vCPUs and 85 GB per GPU.
    "a2-highgpu-1g": MachineType(
        "a2-highgpu-1g", "A2", 12, 85.0, "a100-40gb", (1,), True, Price(3.67, _FN, _FN_DATE)
    ),
    "a2-highgpu-2g": MachineType(
        "a2-highgpu-2g", "A2", 24, 170.0, "a100-40gb", (2,), True, Price(7.35, _PAGE, _PAGE_DATE)
    ),
    # A2 Ultra (a2-ultragpu-*): A100 80 GB SXM4, 12 vCPUs and 170 GB per GPU. FIELD-NOTES asks to check the
    # price on the pricing page; the figure is the 2025 list price.
    "a2-ultragpu-1g": MachineType(
        "a2-ultragpu-1g",
        "A2",
        12,
        170.0,
        "a100-80gb-sxm",
        (1,),
        True,
        Price(5.07, _PAGE, _PAGE_DATE),
        bundled_local_ssd=True,
    ),
    # A3 High (a3-highgpu-*): H100 80 GB SXM5. 1g/2g/4g are sold through Flex-start/Spot only; 8g on demand
    # (cloud.google.com/compute/docs/accelerator-optimized-machines#a3-high-vms, "a3-highgpu-1g, -2g, -4g:
    # Spot and Flex-start only"; FIELD-NOTES "GCP and providers"). The price is the 2025 on-demand list price
    # of the type, which GCE does not sell on demand at 1g: the planner's figure for comparison only.
    "a3-highgpu-1g": MachineType(
        "a3-highgpu-1g",
        "A3",
        26,
        234.0,
        "h100",
        (1,),
        True,
        Price(11.06, _PAGE, _PAGE_DATE),
        sold_as=("spot", "flex-start"),
        bundled_local_ssd=True,
    ),
    "a3-highgpu-8g": MachineType(
        "a3-highgpu-8g",
        "A3",
        208,
        1872.0,
        "h100",
        (8,),
        True,
        Price(88.49, _PAGE, _PAGE_DATE),
        bundled_local_ssd=True,
    ),
    # A3 Ultra (a3-ultragpu-8g): 8 x H200 141 GB. Price not recorded here.
    "a3-ultragpu-8g": MachineType(
        "a3-ultragpu-8g", "A3", 224, 2952.0, "h200", (8,), True, None, bundled_local_ssd=True
    ),
}
"""GCP machine types the planner knows, by name."""

DEFAULT_MACHINE_TYPE: dict[str, str] = {
    "t4": "n1-standard-8",
    "l4": "g2-standard-8",
    "a100-40gb": "a2-highgpu-1g",
    "a100-80gb-sxm": "a2-ultragpu-1g",
    "h100": "a3-highgpu-1g",
    "h200": "a3-ultragpu-8g",
}
"""The machine type a node of each GPU gets when none is named (smallest type with one GPU, 8 vCPUs for
N1/G2 so that the CPU-side work of a few sessions fits). GPUs absent here are not offered on GCP."""

GCP_GPUS: frozenset[str] = frozenset(m.gpu for m in MACHINE_TYPES.values() if m.gpu)
"""GPU keys that GCP offers at all."""

GPU_LABELS: dict[str, str] = {
    "t4": "T4",
    "l4": "L4",
    "a100-40gb": "A100 40 GB",
    "a100-80gb-sxm": "A100 80 GB",
    "h100": "H100",
    "h200": "H200",
}
"""How GCP names each of ``GCP_GPUS`` in its documentation (for messages)."""

STOP_TIMEOUT_METADATA_KEY = "duplexops-stop-timeout-s"
"""Instance metadata key with the seconds a GCE node needs to stop cleanly (its systemd unit's
``TimeoutStopSec``): written by ``infra.components.gce_node``, read by the policy pack's graceful-shutdown
rule."""

IAP_SOURCE_RANGE = "35.235.240.0/20"
"""Source range of Google's Identity-Aware Proxy TCP forwarding (``gcloud compute ssh
--tunnel-through-iap``): cloud.google.com/iap/docs/using-tcp-forwarding."""

ACCELERATOR_TYPES: dict[str, str] = {
    "t4": "nvidia-tesla-t4",
    "l4": "nvidia-l4",
    "a100-40gb": "nvidia-tesla-a100",
    "a100-80gb-sxm": "nvidia-a100-80gb",
    "h100": "nvidia-h100-80gb",
    "h200": "nvidia-h200-141gb",
}
"""GCE accelerator type names (``guestAccelerators[].type``) of ``GCP_GPUS``, by catalog key."""


PROVISIONING_MODELS: dict[str, str] = {"standard": "STANDARD", "spot": "SPOT", "flex-start": "FLEX_START"}
"""Provisioning models of a GCE VM: the stack config's spelling -> ``scheduling.provisioningModel``
(cloud.google.com/compute/docs/instances/provisioning-models). Standard: on demand, runs until stopped.
Spot: up to 60-91 % cheaper, GCE may preempt it at any time with a 30 s notice. Flex-start (Dynamic Workload
Scheduler): waits for capacity, then runs for at most ``FLEX_START_MAX_RUN_S`` and is deleted."""

FLEX_START_MAX_RUN_S = 7 * 24 * 3600
"""The longest a Flex-start VM runs (7 days; cloud.google.com/compute/docs/instances/flex-start-vms):
GCE deletes it then, and the next ``pulumi up`` creates a new one."""


def provisioning_problem(machine_type: str, model: str) -> str | None:
    """Why GCE does not sell ``machine_type`` under provisioning model ``model``, or None when it does.

    Raises:
        ValueError: ``machine_type`` or ``model`` is unknown (names the allowed values).

    >>> provisioning_problem("a3-highgpu-1g", "standard")
    'a3-highgpu-1g is sold only as spot or flex-start, not standard'
    """
    check_choice("provisioning_model", model, sorted(PROVISIONING_MODELS))
    mt = get_machine_type(machine_type)
    if model in mt.sold_as:
        return None
    return f"{machine_type} is sold only as {' or '.join(mt.sold_as)}, not {model}"


def get_machine_type(name: str) -> MachineType:
    """Return the machine type ``name``; ``ValueError`` naming the known types otherwise."""
    check_choice("machine_type", name, sorted(MACHINE_TYPES))
    return MACHINE_TYPES[name]


def carry_problem(machine_type: str, gpu: str) -> str | None:
    """Why ``machine_type`` cannot carry ``gpu``, or None when it can.

    >>> carry_problem("n1-standard-8", "a100-80gb-sxm")
    'n1-standard-8 (N1) cannot carry a100-80gb-sxm: on GCP A100 80 GB comes only with a2-ultragpu-* types'
    """
    mt = get_machine_type(machine_type)
    if gpu == mt.gpu:
        return None
    if gpu not in GCP_GPUS:
        return f"{gpu} is not offered on GCP (no machine type carries it)"
    homes = sorted({m.name.rsplit("-", 1)[0] + "-*" for m in MACHINE_TYPES.values() if m.gpu == gpu})
    label = GPU_LABELS[gpu]
    where = "N1 types (attached)" if gpu == "t4" else " / ".join(homes) + " types"
    return f"{machine_type} ({mt.family}) cannot carry {gpu}: on GCP {label} comes only with {where}"


def machine_types_for(gpu: str) -> list[str]:
    """Machine types that carry ``gpu`` (empty when GCP does not offer it)."""
    return [m.name for m in MACHINE_TYPES.values() if m.gpu == gpu]
