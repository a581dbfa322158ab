"""A node's bundle, rendered from its profile: ``render`` (``render_bundle``: every file of one node) from the
services and their secrets (``services``, ``carriers``, ``redis_acl``), Compose (``compose``,
``compose_host``), nginx, Redis, coturn, TLS and ACME (``nginx``, ``redis_conf``, ``coturn``, ``tls``,
``acme``), the browser client (``webclient``, serving ``infra/node/web/``), and what a GCE VM adds around it
(``cloud_init``, ``first_boot``, ``gce_secrets``, ``rollout``). Its monitoring's files:
``infra.node.monitoring``.
"""
