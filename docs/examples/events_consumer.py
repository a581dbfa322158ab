"""Example consumer of a duplex node's session events (docs/sessions-api.md, "Events").

Reads the Redis Stream ``duplex:events`` with a consumer group: each event is handed to one consumer of
the group, acknowledged (``XACK``) once handled; a consumer that crashed finds its unacknowledged events
again when it restarts (it reads its own pending entries first, then new ones). Delivery is at least once:
the ``event`` field is unique per event, so a duplicate is recognised and skipped.

    python docs/examples/events_consumer.py "$DUPLEX_EVENTS_REDIS_URL" --group my-app --consumer a

(``DUPLEX_EVENTS_REDIS_URL`` from a node's ``secrets/events-consumer.env``: the read-only ``events`` user,
``redis://events:<password>@host:port/0``; never the runtime's URL) prints one JSON object per event. Needs
only redis-py (``pip install redis``). Run several consumers with
the same ``--group`` and different ``--consumer`` names to share the load.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import redis

STREAM = "duplex:events"


def ensure_group(client: redis.Redis, stream: str, group: str, start: str = "0") -> None:
    """Create the consumer group (and the stream if missing); ``start`` "0": from the oldest entry still
    in the stream, "$": only events written from now on. An existing group is left as it is."""
    try:
        client.xgroup_create(stream, group, id=start, mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def consume(
    client: redis.Redis,
    stream: str,
    group: str,
    consumer: str,
    handle: Callable[[dict[str, str]], None],
    *,
    max_events: int | None = None,
    block_ms: int = 5000,
    seen: set[str] | None = None,
) -> int:
    """Hand every event to ``handle``, then acknowledge it; return how many were handled. Stops after
    ``max_events`` (None: never) or when nothing arrives within ``block_ms``."""
    seen = set() if seen is None else seen
    handled = 0
    pending_first = True  # "0": this consumer's own unacknowledged entries (after a crash), then ">": new
    while max_events is None or handled < max_events:
        count = 100 if max_events is None else max_events - handled
        cursor = "0" if pending_first else ">"
        reply = client.xreadgroup(group, consumer, {stream: cursor}, count=count, block=block_ms)
        entries = reply[0][1] if reply else []
        if not entries:
            if pending_first:
                pending_first = False
                continue
            break
        for entry_id, fields in entries:
            if fields["event"] not in seen:  # at-least-once delivery: skip a duplicate
                seen.add(fields["event"])
                handle(fields)
                handled += 1
            client.xack(stream, group, entry_id)
    return handled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "url", help="the node's Redis as the events user, redis://events:<password>@host:port/db"
    )
    parser.add_argument("--group", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--stream", default=STREAM)
    parser.add_argument("--max-events", type=int, default=None, help="exit after this many events")
    parser.add_argument("--block-ms", type=int, default=5000, help="exit when idle this long")
    args = parser.parse_args(argv)
    client = redis.Redis.from_url(args.url, decode_responses=True)
    ensure_group(client, args.stream, args.group)

    def show(fields: dict[str, str]) -> None:
        print(json.dumps(fields), flush=True)

    consume(
        client,
        args.stream,
        args.group,
        args.consumer,
        show,
        max_events=args.max_events,
        block_ms=args.block_ms,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
