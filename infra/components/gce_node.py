"""``GceGpuNode``: one GPU VM on Compute Engine running the node bundle, with its own network and firewall
(public ports from ``public_source_ranges`` only, SSH from IAP only), a static address and a data disk that
both outlive the VM (protected), a least-privilege service account, ``scheduling`` of :func:`scheduling`
(TERMINATE on host maintenance, graceful shutdown covering the drain, the provisioning model) and, on
Spot, a Cloud Scheduler job that starts a preempted VM again. A new image does not replace the VM
(``infra.node.bundle.rollout``); only a new user-data does, and nothing else may
(``IGNORED_INSTANCE_CHANGES``).

What it declares and how the VM behaves: docs/deploying.md, "Stack `dev` (GCP, T4, INT8)"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_gcp.artifactregistry as artifactregistry
import pulumi_gcp.cloudscheduler as cloudscheduler
import pulumi_gcp.compute as compute
import pulumi_gcp.projects as projects
import pulumi_gcp.secretmanager as secretmanager
import pulumi_gcp.serviceaccount as serviceaccount

from infra.capacity.gcp import (
    FLEX_START_MAX_RUN_S,
    IAP_SOURCE_RANGE,  # the only source of SSH
    PROVISIONING_MODELS,
    STOP_TIMEOUT_METADATA_KEY,
)
from infra.components._util import COMPONENT_PACKAGE, child_options, dependencies
from infra.node.bundle.cloud_init import (
    DLVM_IMAGE_FAMILY,
    DLVM_IMAGE_PROJECT,
    USER_DATA_FILE,
    render_cloud_init,
)
from infra.node.bundle.compose import node_stop_timeout_s
from infra.node.bundle.render import render_bundle
from infra.node.bundle.rollout import DATA_DISK_DEVICE, ROLLOUT_METADATA_KEY, add_rollout, pending_image
from infra.node.profile.profiles import NodeProfile
from infra.node.profile.relay import media_firewall_allows
from infra.stack_config import GceSettings

__all__ = [
    "BOOT_IMAGE",
    "GRACEFUL_SHUTDOWN_MAX_S",
    "IAP_SOURCE_RANGE",
    "IGNORED_INSTANCE_CHANGES",
    "NODE_PROJECT_ROLES",
    "SHIELDED_INSTANCE_CONFIG",
    "SPOT_PREEMPTION_NOTICE_S",
    "SPOT_RESTART_SCHEDULE",
    "STOP_TIMEOUT_METADATA_KEY",
    "GceGpuNode",
    "GceGpuNodeArgs",
    "graceful_shutdown_s",
    "render_user_data",
    "reservation_affinity",
    "scheduling",
]


BOOT_IMAGE = f"projects/{DLVM_IMAGE_PROJECT}/global/images/family/{DLVM_IMAGE_FAMILY}"
"""The boot disk's image: the newest image of the Deep Learning VM family the user-data is written for
(a newer image in the family does not replace a running VM)."""

NODE_PROJECT_ROLES = ("roles/logging.logWriter", "roles/monitoring.metricWriter")
"""Project-level roles of the node's service account (nothing broader: no editor, no owner)."""

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
"""OAuth scopes of the VM: cloud-platform, so that IAM roles alone decide what the node may do."""


GRACEFUL_SHUTDOWN_MAX_S = 3600
"""The longest GCE graceful shutdown (``scheduling.gracefulShutdown.maxDuration.seconds``: 1 to 3600, the
pulumi-gcp 10.2 docstring of ``InstanceSchedulingGracefulShutdownMaxDurationArgs``)."""

SPOT_PREEMPTION_NOTICE_S = 30
"""``scheduling.preemption_notice_duration`` of a Spot VM, in seconds: how long the metadata server's
``instance/preempted`` reads TRUE before GCE sends the ACPI soft off (pulumi-gcp 10.2 docstring: "If not
specified, there will be no wait before the G2 Soft Off signal"; then 30 s to the hard off for Spot VMs,
``skip_guest_os_shutdown`` docstring). The runtime's preemption watch (``runtime.frontend.maintenance``)
closes live sessions with 1001 within it. The allowed maximum is not documented in the provider: not
verified on a real VM."""

SPOT_RESTART_SCHEDULE = "*/5 * * * *"
"""Cron schedule (UTC) of the Cloud Scheduler job that starts a Spot VM: GCE stops a preempted Spot VM and
never restarts it (``automatic_restart`` must be false); ``instances.start`` on a running VM does nothing,
and a start refused for lack of Spot capacity is tried again at the next run. At most 5 minutes plus
the boot and the model load from the data disk pass between capacity returning and the node serving."""

IGNORED_INSTANCE_CHANGES = ("scratchDisks",)
"""Instance inputs a refresh must not turn into a replacement. A2 Ultra and A3 types come with Local SSDs
that GCE attaches by itself (cloud.google.com/compute/docs/disks/add-local-ssd); the provider reads them
back into ``scratch_disk``, which is ForceNew, so an undeclared disk replaced the VM on every ``up``
(terraform-provider-google #19648, the same for Z3). The node does not use them (the model cache is on the
data disk); GCE sizes them by machine type, so they are ignored rather than declared."""

SHIELDED_INSTANCE_CONFIG: compute.InstanceShieldedInstanceConfigArgsDict = {
    "enable_secure_boot": False,
    "enable_vtpm": True,
    "enable_integrity_monitoring": True,
}
"""Shielded VM options of the GPU VM. Secure Boot is off: the Deep Learning VM image installs the NVIDIA
driver at first boot by building its kernel modules (DKMS), and those are not signed with a key the
firmware trusts; under Secure Boot the kernel refuses unsigned modules and the GPU is absent
(cloud.google.com/compute/docs/gpus/install-drivers-gpu, "Secure Boot": only drivers signed by the
distribution load). vTPM and integrity monitoring (measured boot) stay on. Not verified on a real VM."""


def graceful_shutdown_s(profile: NodeProfile) -> int:
    """Seconds of GCE graceful shutdown the node needs: the systemd unit's stop timeout, in which nginx
    and the runtime drain their sessions (``infra.node.bundle.compose.node_stop_timeout_s``).

    Raises:
        ValueError: it exceeds ``GRACEFUL_SHUTDOWN_MAX_S`` (GCE would cut the drain short)."""
    needed = node_stop_timeout_s(profile)
    if needed > GRACEFUL_SHUTDOWN_MAX_S:
        raise ValueError(
            f"profile {profile.name!r} needs {needed} s to stop (limits.drain_grace_s "
            f"{profile.limits.drain_grace_s} s + margins); GCE graceful shutdown allows at most "
            f"{GRACEFUL_SHUTDOWN_MAX_S} s: lower limits.drain_grace_s"
        )
    return needed


def scheduling(gce: GceSettings, profile: NodeProfile) -> compute.InstanceSchedulingArgsDict:
    """The VM's ``scheduling`` block.

    - ``on_host_maintenance`` TERMINATE: GPU VMs cannot live-migrate (cloud.google.com/compute/docs/gpus,
      "Handling host maintenance"); GCE announces the event about an hour ahead on the metadata server,
      which the node's maintenance watcher turns into a drain.
    - ``graceful_shutdown`` for :func:`graceful_shutdown_s`: without it a stop, delete or replace gives the
      guest only seconds (GCE's default), which cuts every live conversation; with it systemd stops the
      node unit, whose ``docker compose down`` drains (cloud.google.com/compute/docs/instances/
      graceful-shutdown-overview).
    - the provisioning model (``gce.provisioning_model``): ``standard`` restarts automatically; ``spot``
      must set ``preemptible`` and no automatic restart, and is STOPPED on preemption (disks kept; the
      Cloud Scheduler job of ``SPOT_RESTART_SCHEDULE`` starts it again), with a metadata notice of
      ``SPOT_PREEMPTION_NOTICE_S`` before the soft off (``preemption_notice_duration``; GCE graceful
      shutdown does nothing at a preemption); ``flex-start`` needs ``max_run_duration`` and DELETE
      (pulumi-gcp 10.2 ``provisioning_model`` docstring) and gets **no** graceful shutdown: GCE excludes it
      for VMs with a limited run time (cloud.google.com/compute/docs/instances/graceful-shutdown-overview,
      limitations). Its ``reservation_affinity`` is ``NO_RESERVATION`` (:func:`reservation_affinity`).
    """
    block: compute.InstanceSchedulingArgsDict = {
        "on_host_maintenance": "TERMINATE",
        "provisioning_model": PROVISIONING_MODELS[gce.provisioning_model],
    }
    if gce.provisioning_model != "flex-start":
        block["graceful_shutdown"] = {
            "enabled": True,
            "max_duration": {"seconds": graceful_shutdown_s(profile)},
        }
    if gce.provisioning_model == "standard":
        block["automatic_restart"] = True
    elif gce.provisioning_model == "spot":
        block["preemptible"] = True
        block["automatic_restart"] = False
        block["instance_termination_action"] = "STOP"
        block["preemption_notice_duration"] = {"seconds": SPOT_PREEMPTION_NOTICE_S}
    else:  # flex-start
        block["automatic_restart"] = False
        block["instance_termination_action"] = "DELETE"
        block["max_run_duration"] = {"seconds": FLEX_START_MAX_RUN_S}
    return block


def reservation_affinity(gce: GceSettings) -> compute.InstanceReservationAffinityArgsDict | None:
    """The VM's ``reservation_affinity``: ``NO_RESERVATION`` for Flex-start, which must not consume a
    reservation (``--reservation-affinity=none`` in "Create a Flex-start VM",
    cloud.google.com/compute/docs/instances/create-flex-start-vm); None (GCE's default) otherwise."""
    return {"type": "NO_RESERVATION"} if gce.provisioning_model == "flex-start" else None


def render_user_data(
    profile: NodeProfile, image_ref: str, secret_ids: Mapping[str, str], project_id: str
) -> str:
    """The cloud-init user-data of ``profile`` running an image of ``image_ref``'s repository, its secrets
    named by Secret Manager id (``{role: id}``) in ``project_id``, with the rollout agent and the data disk
    of ``infra.node.bundle.rollout``. The digest is not in it (``pending_image``): a new digest changes only
    the
    metadata key ``ROLLOUT_METADATA_KEY``, never the user-data.

    Raises:
        ValueError: ``image_ref`` is not digest-pinned, or a renderer refuses the profile."""
    node = profile.model_copy(update={"runtime_image": pending_image(image_ref)})
    bundle = render_bundle(node)
    files = render_cloud_init(node, bundle, secret_manager_secrets=dict(secret_ids), project_id=project_id)
    return add_rollout(files[USER_DATA_FILE].decode(), node)


@dataclass(frozen=True)
class GceGpuNodeArgs:
    """One GCE GPU node.

    Attributes:
        name_prefix: prefix of every resource's cloud name (VM ``<prefix>-node``).
        gce: where and on what it runs (the stack's validated settings: project, region, zone, machine
            type, the GPU to attach on N1 types, boot disk, public source ranges, subnet).
        profile: the node profile (its ``runtime_image`` is replaced by ``image_ref``).
        image_ref: the digest-pinned image the node runs.
        image_repository: the Artifact Registry repository holding it (the VM may read it only).
        secret_ids: ``{role: Secret Manager secret id}`` for the user-data.
        secrets: the Secret Manager secrets the VM may read (``{role: secret}``).
        boot_after: resources that must exist before the VM boots (secret versions).
        labels: labels of the VM and its address.
        image_repository_path: ``image_ref``'s repository (``<registry>/<project>/<repo>/<image>``), known
            before the image is built: the user-data is rendered from it, so a preview of a new digest
            (unknown until the build) shows the user-data unchanged, i.e. no VM replacement; None: rendered
            from ``image_ref`` (a preview of a new build then shows ``user-data`` unknown and the VM
            replaced, though the ``up`` replaces nothing).
    """

    name_prefix: str
    gce: GceSettings
    profile: NodeProfile
    image_ref: pulumi.Input[str]
    image_repository: artifactregistry.Repository
    secret_ids: Mapping[str, str]
    secrets: Mapping[str, pulumi.CustomResource]
    boot_after: Sequence[pulumi.Resource] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    image_repository_path: str | None = None

    @property
    def network_tag(self) -> str:
        return f"{self.name_prefix}-node"

    @property
    def instance_name(self) -> str:
        return f"{self.name_prefix}-node"


class GceGpuNode(pulumi.ComponentResource):
    """A GPU VM running the node bundle, with its network, firewall, address and service account."""

    instance: compute.Instance
    address: compute.Address
    data_disk: compute.Disk
    restarter: cloudscheduler.Job | None
    service_account: serviceaccount.Account
    external_ip: pulumi.Output[str]
    user_data: pulumi.Output[str]
    instance_name: str
    zone: str
    project: str

    def __init__(self, name: str, args: GceGpuNodeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PACKAGE}:GceGpuNode", name, None, opts)
        deps = dependencies(opts)
        gce = args.gce
        prefix, project, profile = args.name_prefix, gce.project, args.profile
        self.instance_name, self.zone, self.project = args.instance_name, gce.zone, project

        network = compute.Network(
            f"{name}-network",
            name=f"{prefix}-net",
            project=project,
            auto_create_subnetworks=False,
            description="duplexops node network: only the node's firewall rules apply",
            opts=child_options(self, deps),
        )
        subnet = compute.Subnetwork(
            f"{name}-subnet",
            name=f"{prefix}-subnet",
            project=project,
            region=gce.region,
            network=network.id,
            ip_cidr_range=gce.subnet_cidr,
            private_ip_google_access=True,
            opts=child_options(self, deps),
        )
        public_ports = sorted({profile.ports.http, profile.ports.https})
        web = compute.Firewall(
            f"{name}-allow-web",
            name=f"{prefix}-allow-web",
            project=project,
            network=network.id,
            direction="INGRESS",
            allows=[{"protocol": "tcp", "ports": [str(p) for p in public_ports]}],
            source_ranges=list(gce.public_source_ranges),
            target_tags=[args.network_tag],
            description="nginx: HTTPS (WebSocket sessions) and HTTP (redirect) from the configured ranges",
            opts=child_options(self, deps),
        )
        media = media_firewall_allows(profile.relay)
        firewalls = [web]
        if media:  # WebRTC media through the TURN relay: its two listeners, never its relay range
            firewalls.append(
                compute.Firewall(
                    f"{name}-allow-turn",
                    name=f"{prefix}-allow-turn",
                    project=project,
                    network=network.id,
                    direction="INGRESS",
                    allows=[
                        compute.FirewallAllowArgs(protocol=a["protocol"], ports=a["ports"]) for a in media
                    ],
                    source_ranges=list(gce.public_source_ranges),
                    target_tags=[args.network_tag],
                    description="coturn: TURN over UDP and TLS (WebRTC media) from the configured ranges",
                    opts=child_options(self, deps),
                )
            )
        ssh = compute.Firewall(
            f"{name}-allow-iap-ssh",
            name=f"{prefix}-allow-iap-ssh",
            project=project,
            network=network.id,
            direction="INGRESS",
            allows=[{"protocol": "tcp", "ports": ["22"]}],
            source_ranges=[IAP_SOURCE_RANGE],
            target_tags=[args.network_tag],
            description="SSH through Identity-Aware Proxy only (gcloud compute ssh --tunnel-through-iap)",
            opts=child_options(self, deps),
        )
        self.address = compute.Address(
            f"{name}-address",
            name=f"{prefix}-ip",
            project=project,
            region=gce.region,
            address_type="EXTERNAL",
            network_tier="PREMIUM",
            labels=dict(args.labels),
            opts=child_options(self, deps, protect=True),
        )
        self.data_disk = compute.Disk(
            f"{name}-data",
            name=f"{prefix}-data",
            project=project,
            zone=gce.zone,
            type=gce.boot_disk_type,
            size=gce.data_disk_gb,
            labels={**args.labels, "role": "data"},
            description="duplexops node data: model cache, Redis, Prometheus, Grafana (kept across VMs)",
            opts=child_options(self, deps, protect=True),
        )

        self.service_account = serviceaccount.Account(
            f"{name}-service-account",
            project=project,
            account_id=f"{prefix}-node",
            display_name=f"duplexops node {prefix}",
            description="Runs the duplexops node VM: writes logs and metrics, reads its image and secrets",
            opts=child_options(self, deps),
        )
        member = self.service_account.email.apply(lambda email: f"serviceAccount:{email}")
        grants: list[pulumi.Resource] = []
        for role in NODE_PROJECT_ROLES:
            grants.append(
                projects.IAMMember(
                    f"{name}-{role.split('/')[-1].replace('.', '-').lower()}",
                    project=project,
                    role=role,
                    member=member,
                    opts=child_options(self, deps),
                )
            )
        grants.append(
            artifactregistry.RepositoryIamMember(
                f"{name}-image-reader",
                project=project,
                location=args.image_repository.location,
                repository=args.image_repository.repository_id,
                role="roles/artifactregistry.reader",
                member=member,
                opts=child_options(self, deps),
            )
        )
        for role, secret in sorted(args.secrets.items()):
            grants.append(
                secretmanager.SecretIamMember(
                    f"{name}-reads-{role.replace('_', '-')}",
                    project=project,
                    secret_id=secret.secret_id,  # type: ignore[attr-defined]
                    role="roles/secretmanager.secretAccessor",
                    member=member,
                    opts=child_options(self, deps),
                )
            )

        secret_ids = dict(args.secret_ids)
        if args.image_repository_path is not None:
            # The user-data names the repository only (pending_image): render it from what a preview knows.
            known = f"{args.image_repository_path}@sha256:{'0' * 64}"
            self.user_data = pulumi.Output.from_input(render_user_data(profile, known, secret_ids, project))
        else:
            self.user_data = pulumi.Output.from_input(args.image_ref).apply(
                lambda image_ref: render_user_data(profile, image_ref, secret_ids, project)
            )
        accelerators: list[compute.InstanceGuestAcceleratorArgsDict] | None = None
        if gce.accelerator_type is not None:  # N1: attached; A2/G2/A3 types come with their GPUs
            accelerators = [{"type": gce.accelerator_type, "count": gce.accelerator_count}]
        self.instance = compute.Instance(
            f"{name}-vm",
            name=args.instance_name,
            project=project,
            zone=gce.zone,
            machine_type=gce.machine_type,
            guest_accelerators=accelerators,
            scheduling=scheduling(gce, profile),
            reservation_affinity=reservation_affinity(gce),
            attached_disks=[{"source": self.data_disk.name, "device_name": DATA_DISK_DEVICE}],
            boot_disk={
                "auto_delete": True,
                "initialize_params": {
                    "image": BOOT_IMAGE,
                    "size": gce.boot_disk_gb,
                    "type": gce.boot_disk_type,
                },
            },
            network_interfaces=[
                {
                    "subnetwork": subnet.id,
                    "access_configs": [{"nat_ip": self.address.address, "network_tier": "PREMIUM"}],
                }
            ],
            shielded_instance_config={**SHIELDED_INSTANCE_CONFIG},
            service_account={"email": self.service_account.email, "scopes": list(SCOPES)},
            metadata={
                "user-data": self.user_data,
                "enable-oslogin": "TRUE",
                # The node publishes its certificate's fingerprint there (infra.node.bundle.cloud_init).
                "enable-guest-attributes": "TRUE",
                "block-project-ssh-keys": "TRUE",
                STOP_TIMEOUT_METADATA_KEY: str(node_stop_timeout_s(profile)),
                ROLLOUT_METADATA_KEY: args.image_ref,
            },
            tags=[args.network_tag],
            labels={**args.labels, "profile": profile.name},
            allow_stopping_for_update=True,
            opts=child_options(
                self,
                [*deps, *grants, *args.boot_after, *firewalls, ssh],
                replace_on_changes=['metadata["user-data"]'],
                ignore_changes=list(IGNORED_INSTANCE_CHANGES),
                delete_before_replace=True,
            ),
        )
        self.restarter = None
        if gce.provisioning_model == "spot":
            self.restarter = self._spot_restarter(name, args, deps)
        self.external_ip = self.address.address
        self.register_outputs(
            {
                "instance_name": self.instance.name,
                "external_ip": self.external_ip,
                "service_account": self.service_account.email,
            }
        )

    def _spot_restarter(
        self, name: str, args: GceGpuNodeArgs, deps: list[pulumi.Resource]
    ) -> cloudscheduler.Job:
        """A Cloud Scheduler job that POSTs ``instances.start`` for the VM every ``SPOT_RESTART_SCHEDULE``,
        as a service account holding ``roles/compute.instanceAdmin.v1`` on this VM only (the narrowest
        predefined role with ``compute.instances.start``)."""
        gce, prefix = args.gce, args.name_prefix
        account = serviceaccount.Account(
            f"{name}-restarter",
            project=gce.project,
            account_id=f"{prefix}-restart",
            display_name=f"duplexops Spot restarter {prefix}",
            description="Starts the Spot node VM again after a preemption (Cloud Scheduler)",
            opts=child_options(self, deps),
        )
        grant = compute.InstanceIAMMember(
            f"{name}-restarter-starts-vm",
            project=gce.project,
            zone=gce.zone,
            instance_name=self.instance.name,
            role="roles/compute.instanceAdmin.v1",
            member=account.email.apply(lambda email: f"serviceAccount:{email}"),
            opts=child_options(self, deps),
        )
        uri = (
            f"https://compute.googleapis.com/compute/v1/projects/{gce.project}/zones/{gce.zone}"
            f"/instances/{args.instance_name}/start"
        )
        return cloudscheduler.Job(
            f"{name}-restart",
            name=f"{prefix}-restart",
            project=gce.project,
            region=gce.region,
            description="Start the Spot node VM after a preemption (a no-op while it runs)",
            schedule=SPOT_RESTART_SCHEDULE,
            time_zone="Etc/UTC",
            attempt_deadline="60s",
            http_target={
                "http_method": "POST",
                "uri": uri,
                "oauth_token": {
                    "service_account_email": account.email,
                    "scope": "https://www.googleapis.com/auth/cloud-platform",
                },
            },
            opts=child_options(self, [*deps, grant]),
        )

    def ssh_command(self) -> str:
        """How an operator opens a shell on the VM (IAP tunnel, OS Login)."""
        return (
            f"gcloud compute ssh {self.instance_name} --project {self.project} --zone {self.zone} "
            "--tunnel-through-iap"
        )

    def tunnel_command(self, local_port: int, remote: str) -> str:
        """An SSH tunnel through IAP forwarding ``localhost:<local_port>`` to ``remote`` on the VM."""
        return f"{self.ssh_command()} -- -N -L {local_port}:{remote}"
