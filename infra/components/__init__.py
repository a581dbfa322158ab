"""Reusable Pulumi components of the duplexops stacks.

- ``image.RuntimeImage``: an Artifact Registry repository and the runtime image built and pushed into it.
- ``node_secrets.StackSecrets``: the node's passwords (given or generated) and, for GCE, their Secret
  Manager secrets.
- ``gce_node.GceGpuNode``: one GPU VM on GCE booting the node bundle with cloud-init.
- ``onprem_node.OnPremNode``: an existing GPU host brought up over SSH.

Each component takes one typed args object, parents every child to itself and registers its outputs.
Import the module you need (``from infra.components.gce_node import GceGpuNode``): each one imports only
the provider modules it uses.
"""
