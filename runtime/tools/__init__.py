"""Operator tools: the ``duplex-runtime`` CLI, the load generator, benchmarks, a local Redis for tests."""
