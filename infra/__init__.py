"""Infrastructure of the duplex runtime: the capacity planner (``infra.capacity``) and the stacks."""
