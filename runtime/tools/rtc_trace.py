"""``python -m runtime.tools.rtc_trace --log runtime.log --report run.json``: where a WebRTC session's first
audio spent its time, term by term, from the node's own stamps and the load generator's.

The node logs one line per WebRTC session when it ends (``WebRTC session <id> first audio: {...}``, the
stamps of ``runtime.frontend.transports.webrtc.media.FirstAudioTrace``); the WebRTC load generator reports,
per session,
its ``session_id`` and its own ``stamps`` (``runtime.tools.loadgen_rtc.RtcSessionResult``). On one machine
both read the same monotonic clock, so the two join into one timeline per session:

- ``handshake_trip``: the node hands 0x00 to the DataChannel -> the client has it (SCTP over DTLS, through
  the relay);
- ``first_packet_trip``: the client sends its first packet (right after the 0x00) -> the node has it;
- ``frame_packetisation``: first packet sent -> the 4th sent (the node's first 1920-sample frame);
- ``inbound_transit``: that 4th packet sent -> arrived on the node (the relay hop, SRTP, aiortc);
- ``jitter_hold``: arrived -> handed to the session (our jitter buffer and libopus);
- ``engine``: the frame handed to the session -> its first 80 ms of audio at the outbound track (tick
  phase, the ticks, the step: the same path as ``/api/chat``);
- ``pacing``: -> its first packet handed to aiortc's RTP sender (one encode, the event loop's turn);
- ``outbound_transit``: -> the client has it (SRTP, the relay hop, the client's event loop);
- ``first_audio``: the client's figure (``first_audio_ms``): the sum of the last five.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from runtime.tools.loadgen import _percentile

__all__ = ["TERMS", "join_traces", "node_traces", "summarize"]

_LINE = re.compile(r"WebRTC session (\w+) first audio: (\{.*\})")

TERMS: tuple[tuple[str, str, str, str], ...] = (
    # name, (side, stamp) from, (side, stamp) to: "c" the client's stamps, "n" the node's
    ("handshake_trip", "n:handshake_at", "c:handshake", ""),
    ("first_packet_trip", "c:packet0", "n:first_rtp_at", ""),
    ("frame_packetisation", "c:packet0", "c:packet3", ""),
    ("inbound_transit", "c:packet3", "n:frame_arrived_at", "first_audio"),
    ("jitter_hold", "n:frame_arrived_at", "n:frame_at", "first_audio"),
    ("engine", "n:frame_at", "n:audio_put_at", "first_audio"),
    ("pacing", "n:audio_put_at", "n:audio_sent_at", "first_audio"),
    ("outbound_transit", "n:audio_sent_at", "c:first_audio", "first_audio"),
)
"""Each term: its name, its start and end stamps (``c:`` client, ``n:`` node), and ``first_audio`` when it
is part of the client's like-for-like first audio (from the 4th packet's send to the first packet back)."""


def node_traces(lines: Iterable[str]) -> dict[str, dict[str, float | None]]:
    """The node's first-audio stamps by session id, from its log ``lines`` (other lines ignored).

    Raises:
        json.JSONDecodeError: a trace line whose stamps are not JSON (a cut log line).
    """
    traces: dict[str, dict[str, float | None]] = {}
    for line in lines:
        match = _LINE.search(line)
        if match:
            traces[match.group(1)] = json.loads(match.group(2))
    return traces


def join_traces(
    sessions: Sequence[Mapping[str, object]], traces: Mapping[str, Mapping[str, float | None]]
) -> list[dict[str, float]]:
    """One dict of terms (ms) per session of ``sessions`` (the load report's session rows) found in
    ``traces``; a term whose stamps are missing is left out."""
    rows: list[dict[str, float]] = []
    for session in sessions:
        node = traces.get(str(session.get("session_id", "")))
        client = session.get("stamps")
        if node is None or not isinstance(client, Mapping):
            continue
        sides = {"c": client, "n": node}
        row: dict[str, float] = {}
        for name, start, end, _ in TERMS:
            a = sides[start[0]].get(start[2:])
            b = sides[end[0]].get(end[2:])
            if isinstance(a, float | int) and isinstance(b, float | int):
                row[name] = (b - a) * 1e3
        if isinstance(session.get("first_audio_ms"), float | int):
            row["first_audio"] = float(session["first_audio_ms"])  # type: ignore[arg-type]
        rows.append(row)
    return rows


def summarize(rows: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float | None]]:
    """p50, p99 and mean (ms) of each term over ``rows`` (:func:`join_traces`)."""
    names = [name for name, *_ in TERMS] + ["first_audio"]
    out: dict[str, dict[str, float | None]] = {}
    for name in names:
        values = [row[name] for row in rows if name in row]
        out[name] = {
            "p50": _percentile(values, 50),
            "p99": _percentile(values, 99),
            "mean": sum(values) / len(values) if values else None,
        }
    return out


def _sessions(report: Mapping[str, object]) -> list[Mapping[str, object]]:
    """The WebRTC session rows of a ``duplex loadgen --transport webrtc --json`` or ``duplex node up
    --json`` output."""
    webrtc = report.get("webrtc")
    source = webrtc if isinstance(webrtc, Mapping) else report
    sessions = source.get("sessions")
    if not isinstance(sessions, list):
        raise ValueError("no WebRTC sessions in the report (duplex node up --json, or loadgen --json)")
    return sessions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, required=True, help="the node's runtime log")
    parser.add_argument("--report", type=Path, required=True, help="the load generator's JSON output")
    args = parser.parse_args(argv)
    text = args.report.read_text()
    report, _ = json.JSONDecoder().raw_decode(text[text.index("{") :])
    rows = join_traces(_sessions(report), node_traces(args.log.read_text().splitlines()))
    if not rows:
        parser.error("no session of the report has a first-audio line in the log")
    summary = summarize(rows)
    print(f"{len(rows)} sessions (ms)   p50      p99      mean")
    for name, figures in summary.items():
        cells = ["       -" if figures[k] is None else f"{figures[k]:8.1f}" for k in ("p50", "p99", "mean")]
        print(f"{name:<22}" + " ".join(cells))


if __name__ == "__main__":
    main()
