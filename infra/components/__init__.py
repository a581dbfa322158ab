"""Reusable Pulumi components of the duplexops stacks.

- ``image.RuntimeImage``: an Artifact Registry repository and the runtime image built and pushed into it.
- ``node_secrets.StackSecrets``: the node's passwords (given or generated) and, for GCE, their Secret
  Manager secrets.
- ``gce_node.GceGpuNode``: one GPU VM on GCE booting the node bundle with cloud-init.
- ``onprem_node.OnPremNode``: an existing GPU host brought up over SSH.
- ``gke_region.GkeRegion``: one region of the multi-region stack, made of ``gke_parts`` (network, service
  accounts, cluster, node pools, Memorystore, model bucket); ``regional_runtime.RegionalRuntime``: the
  region's Kubernetes objects (``infra.k8s``) on its cluster; ``global_entry.GlobalEntry``: the global
  HTTPS load balancer over every region.

Each component takes one typed args object, parents every child to itself and registers its outputs.
Import the module you need (``from infra.components.gce_node import GceGpuNode``): each one imports only
the provider modules it uses.
"""
