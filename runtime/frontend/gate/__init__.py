"""The gate: who may open a conversation, checked before a slot is taken: the caller's address, the rate
limits, the origin, the session token (and application tokens for the sessions API), replay, and the
refusal table every transport answers from; the client's query as a typed request (``gate.query``)."""
