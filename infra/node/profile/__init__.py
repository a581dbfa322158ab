"""A node's profile: the one typed description (``profiles``: ``NodeProfile``, the built-in
``PROFILES``), its sections (``sections``: ports, TLS, alert receivers, limits, retention) and its TURN relay
(``relay``), from which every file of the node is rendered (``infra.node.bundle.render``). Imports nothing
else of the node (tests/test_import_graph.py).
"""
