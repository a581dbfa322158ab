"""Network traffic per session and per node: raw PCM or Opus audio over Kyutai's WebSocket protocol.

Per direction and per 80 ms frame, one binary WebSocket message carries one kind byte + the audio (Kyutai's
protocol, FIELD-NOTES "Wire protocol"); the server also sends at most one text piece (kind 0x02) per frame.
Overheads, per message: the WebSocket frame header (RFC 6455 section 5.2: 2 bytes up to 125 bytes of
payload, 4 up to 65535, 10 beyond; client-to-server frames add a 4-byte mask key), one TLS 1.3 record
(RFC 8446: 5-byte header + 1 content-type byte + 16-byte AEAD tag), and TCP/IPv4 headers of 52 bytes per
segment (20 IP + 20 TCP + 12 timestamp option) with a 1448-byte MSS. ACKs and Ethernet framing are left
out.

Raw PCM: 24 kHz x 16-bit mono = 48,000 bytes/s = 384 kbit/s in each direction (768 both ways).
Opus: sphn 0.2.1's ``OpusStreamWriter(24000)`` produced 31.2 kbit/s of Ogg/Opus pages on a tone + noise
signal, one page per 80 ms frame (measured on this project's build machine); the default is 32 kbit/s.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

from runtime.engine.model_presets import FRAME_MS, FRAME_RATE_HZ, SAMPLE_RATE_HZ

Codec = Literal["pcm", "opus"]
CODECS: tuple[str, ...] = ("pcm", "opus")

PCM_BYTES_PER_SAMPLE = 2
DEFAULT_OPUS_KBPS = 32.0
"""Ogg/Opus bit rate per direction (kbit/s), see module docstring."""
TEXT_PIECE_BYTES = 4
"""Average UTF-8 payload of one text piece (bytes): assumption, one per frame at most."""
TLS_RECORD_OVERHEAD = 22
TCP_IP_HEADER = 52
MSS = 1448


def ws_header_bytes(payload: int, masked: bool) -> int:
    """WebSocket frame header for ``payload`` bytes (RFC 6455 section 5.2)."""
    base = 2 if payload <= 125 else 4 if payload <= 65535 else 10
    return base + (4 if masked else 0)


class DirectionTraffic(BaseModel):
    """One direction of one session, in bits per second on each layer."""

    model_config = ConfigDict(frozen=True)

    direction: str
    audio_bps: float
    websocket_bps: float
    tls_bps: float
    tcp_ip_bps: float
    total_bps: float


class NetworkPlan(BaseModel):
    """Traffic of one session, one node (``sessions`` sessions) and all nodes (bits per second)."""

    model_config = ConfigDict(frozen=True)

    codec: str
    per_session: list[DirectionTraffic]
    session_total_bps: float
    session_overhead_bps: float
    node_sessions: int
    node_ingress_bps: float
    node_egress_bps: float
    nodes: int
    fleet_ingress_bps: float
    fleet_egress_bps: float


def _direction(name: str, audio_bytes: float, masked: bool, text: bool) -> DirectionTraffic:
    msgs = [1 + audio_bytes] + ([1 + TEXT_PIECE_BYTES] if text else [])
    ws = sum(ws_header_bytes(int(m), masked) + 1 for m in msgs)  # header + kind byte
    tls = TLS_RECORD_OVERHEAD * len(msgs)
    wire = [m + ws_header_bytes(int(m), masked) + TLS_RECORD_OVERHEAD for m in msgs]
    tcp = sum(math.ceil(w / MSS) for w in wire) * TCP_IP_HEADER
    per_s = FRAME_RATE_HZ * 8  # frames per second x bits per byte
    audio = audio_bytes * per_s
    text_b = TEXT_PIECE_BYTES * per_s if text else 0.0
    return DirectionTraffic(
        direction=name,
        audio_bps=audio + text_b,
        websocket_bps=ws * per_s,
        tls_bps=tls * per_s,
        tcp_ip_bps=tcp * per_s,
        total_bps=audio + text_b + (ws + tls + tcp) * per_s,
    )


def network_plan(
    sessions: int, nodes: int = 1, codec: str = "opus", opus_kbps: float = DEFAULT_OPUS_KBPS
) -> NetworkPlan:
    """Traffic for ``sessions`` sessions per node on ``nodes`` nodes with ``codec`` (``pcm`` or ``opus``)."""
    if codec == "pcm":
        frame_bytes = SAMPLE_RATE_HZ * PCM_BYTES_PER_SAMPLE * FRAME_MS / 1000
    elif codec == "opus":
        frame_bytes = opus_kbps * 1000 / 8 * FRAME_MS / 1000
    else:
        raise ValueError(f"codec: unknown value {codec!r}; allowed values: {', '.join(CODECS)}")
    up = _direction("client to server", frame_bytes, masked=True, text=False)
    down = _direction("server to client", frame_bytes, masked=False, text=True)
    total = up.total_bps + down.total_bps
    return NetworkPlan(
        codec=codec,
        per_session=[up, down],
        session_total_bps=total,
        session_overhead_bps=total - up.audio_bps - down.audio_bps,
        node_sessions=sessions,
        node_ingress_bps=sessions * up.total_bps,
        node_egress_bps=sessions * down.total_bps,
        nodes=nodes,
        fleet_ingress_bps=nodes * sessions * up.total_bps,
        fleet_egress_bps=nodes * sessions * down.total_bps,
    )
