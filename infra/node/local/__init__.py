"""The node brought up on this machine and its checks: ``node`` (``LocalNode``: every service as a real
process on loopback, from the rendered bundle) on ``network``'s free ports and addresses; ``bringup``
(``duplex node up``: real load through it, its figures read back through ``prometheus_api``), with its resume
step (``resume_check``) and LiveKit row (``livekit_row``); the browser checks (``browser_connects``,
``playout_bench``, over ``browser_launch`` and ``jitter_relay``). Above the bundle and the monitoring, which
it runs.
"""
