"""The front end: the wire protocol, Opus, HTTP and WebSockets, session tokens, the session store,
rate limits, the maintenance watch; one process or N workers beside the engine process (docs/runtime.md)."""
