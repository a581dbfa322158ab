"""The engine side: the model, slots, sampling, personas and the 80 ms tick (no caller sockets).
Nothing here imports ``runtime.frontend`` or ``runtime.tools`` (tests/test_import_graph.py)."""
