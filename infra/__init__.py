"""The deployment of the duplex runtime: the capacity planner (``infra.capacity``), the node (``infra.node``),
a region's Kubernetes objects (``infra.k8s``), the stack configuration, the Pulumi components and program,
the policy pack and the ``duplex`` CLI (``infra.cli``). Layers and layout: README, "Layout"."""
