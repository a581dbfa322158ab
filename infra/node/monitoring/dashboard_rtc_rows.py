"""The node dashboard's transport rows (``infra.node.monitoring.grafana.node_dashboard``): sessions by
transport and WebRTC's media and signalling (issue 22), and the TURN relay (coturn) where its exporter is
scraped.

The series: ``runtime/metrics.py`` (``duplex_transport_sessions_*``, ``duplex_rtp_packets_total{outcome}``,
``duplex_rtp_jitter_buffer_depth_packets``, ``duplex_rtc_answer_seconds``, ``duplex_rtc_connect_seconds``);
coturn 4.6.3's exporter (``turn_total_allocations{type}``, ``turn_total_traffic_*``: bytes and packets of
allocations that have ended; ``infra.node.monitoring.rtc_rules``). Thresholds drawn are the alerts'
(``rtc_rules``) and issue 22's goals.
"""

from __future__ import annotations

from grafana_foundation_sdk.models import units

from infra.node.monitoring.grafana_panels import PanelBuilder, PanelKit
from infra.node.monitoring.rtc_rules import (
    RTC_CONNECT_P99_ALERT_S,
    RTC_UNCONNECTED_ALERT_FRACTION,
    RTP_CONCEALED_ALERT_FRACTION,
)

__all__ = ["ANSWER_GOAL_S", "JITTER_CAP_S", "PACKET_S", "turn_row", "webrtc_row"]

PACKET_S = 0.02
"""One inbound RTP packet's audio: 20 ms of Opus."""
JITTER_CAP_S = 0.12
"""The jitter buffer's hard cap (``runtime/frontend/transports/webrtc/jitter.py``): 6 packets, 120 ms."""
ANSWER_GOAL_S = 0.05
"""Issue 22's goal for POST to answer: at most 50 ms."""

_RTP = "duplex_rtp_packets_total"


def _rtp(kit: PanelKit, outcomes: str) -> str:
    """The selected RTP packets a second with ``outcome`` matching ``outcomes`` (a regex), summed."""
    return f'sum(rate(duplex_rtp_packets_total{{{kit.selector},outcome=~"{outcomes}"}}[$__rate_interval]))'


def webrtc_row(kit: PanelKit) -> list[PanelBuilder]:
    """Sessions and starts by transport, RTP packets by outcome, loss and concealment, jitter buffer depth,
    answered calls not connecting, POST to answer and POST to connected p50/p99."""
    depth = "duplex_rtp_jitter_buffer_depth_packets"
    mean_depth = f"sum({kit.rate(depth + '_sum')}) / sum({kit.rate(depth + '_count')})"
    answers = f"sum({kit.rate('duplex_rtc_answer_seconds_count')})"
    connects = f"sum({kit.rate('duplex_rtc_connect_seconds_count')})"
    return [
        kit.timeseries(
            "Sessions by transport",
            "Sessions holding a slot, by transport: websocket (/api/chat) or webrtc (/api/rtc).",
            units.Short,
            [(f"sum by (transport) ({kit.m('duplex_transport_sessions_active')})", "{{transport}}")],
            width=8,
            stacked=True,
            decimals=0,
        ),
        kit.timeseries(
            "Session starts by transport",
            "Sessions admitted per second, by transport.",
            units.CountsPerSecond,
            [
                (
                    f"sum by (transport) ({kit.rate('duplex_transport_sessions_started_total')})",
                    "{{transport}}",
                )
            ],
            width=8,
        ),
        kit.timeseries(
            "RTP packets by outcome",
            "Inbound WebRTC audio packets (20 ms each) per second: received; late (came after their slot "
            "was concealed: dropped); concealed (slots filled by Opus loss concealment); lost (concealed and "
            "never came: counted when each session ends).",
            units.PacketsPerSecond,
            [(f"sum by (outcome) ({kit.rate(_RTP)})", "{{outcome}}")],
            width=8,
        ),
        kit.timeseries(
            "RTP concealment and loss",
            "Concealed: share of the 20 ms slots played that were concealed (lost or late), counted as it "
            "happens (what RtpLossHigh reads). Lost: packets that never came / (received + lost), RFC "
            "3550's fraction lost, counted when each session ends.",
            units.PercentUnit,
            [
                (
                    f"{_rtp(kit, 'concealed')} / ({_rtp(kit, 'received|concealed')} - {_rtp(kit, 'late')})",
                    "concealed",
                ),
                (f"{_rtp(kit, 'lost')} / {_rtp(kit, 'received|lost')}", "lost"),
            ],
            width=8,
            threshold=(RTP_CONCEALED_ALERT_FRACTION, "RtpLossHigh's threshold"),
        ),
        kit.timeseries(
            "Jitter buffer depth",
            "Audio held in the WebRTC sessions' jitter buffers after each playout (packets x 20 ms): one "
            "packet on a clean path, up to 60 ms under jitter; it never grows after loss.",
            units.Seconds,
            [
                (f"{kit.quantile(0.5, depth)} * {PACKET_S:g}", "p50"),
                (f"{kit.quantile(0.99, depth)} * {PACKET_S:g}", "p99"),
                (f"{mean_depth} * {PACKET_S:g}", "mean"),
            ],
            width=8,
            threshold=(JITTER_CAP_S, f"the hard cap, {JITTER_CAP_S * 1000:g} ms"),
        ),
        kit.timeseries(
            "Answered calls not connecting",
            "Share of WebRTC calls answered that never connected (ICE or DTLS failed, or the connect "
            "timeout): browsers fall back to the WebSocket after 3 s.",
            units.PercentUnit,
            [(f"clamp_min(({answers} - {connects}) / {answers}, 0)", "not connected")],
            width=8,
            max_value=1,
            threshold=(RTC_UNCONNECTED_ALERT_FRACTION, "RtcCallsNotConnecting's threshold"),
        ),
        kit.timeseries(
            "WebRTC POST to answer p50 / p99",
            "From the POST of the SDP offer to the answer ready (admission and ICE gathering).",
            units.Seconds,
            [
                (kit.quantile(0.5, "duplex_rtc_answer_seconds"), "p50"),
                (kit.quantile(0.99, "duplex_rtc_answer_seconds"), "p99"),
            ],
            width=12,
            threshold=(ANSWER_GOAL_S, f"the goal, {ANSWER_GOAL_S * 1000:g} ms"),
        ),
        kit.timeseries(
            "WebRTC POST to connected p50 / p99",
            "From the POST of the SDP offer to the peer connection connected (ICE and DTLS done).",
            units.Seconds,
            [
                (kit.quantile(0.5, "duplex_rtc_connect_seconds"), "p50"),
                (kit.quantile(0.99, "duplex_rtc_connect_seconds"), "p99"),
            ],
            width=12,
            threshold=(RTC_CONNECT_P99_ALERT_S, "RtcConnectSlow's threshold (p99)"),
        ),
    ]


def turn_row(kit: PanelKit) -> list[PanelBuilder]:
    """coturn's exporter: up, allocations by type, relayed traffic (bytes of allocations that ended)."""
    traffic = [
        (f"sum({kit.rate('turn_total_traffic_rcvb')})", "from callers"),
        (f"sum({kit.rate('turn_total_traffic_sentb')})", "to callers"),
        (f"sum({kit.rate('turn_total_traffic_peer_rcvb')})", "from the runtime"),
        (f"sum({kit.rate('turn_total_traffic_peer_sentb')})", "to the runtime"),
    ]
    return [
        kit.stat(
            "TURN relay up",
            "Prometheus's scrape of coturn's exporter (down: WebRTC calls cannot reach the runtime).",
            [(f'min(up{{{kit.selector},job="coturn"}})', "coturn")],
            {"0": ("down", "red"), "1": ("up", "green")},
            width=4,
        ),
        kit.timeseries(
            "TURN allocations by type",
            "Relay allocations open now, by the caller's transport to coturn (UDP, TCP, TLS, DTLS): about "
            "two per relayed WebRTC call.",
            units.Short,
            [(f"sum by (type) ({kit.m('turn_total_allocations')})", "{{type}}")],
            width=10,
            stacked=True,
            decimals=0,
        ),
        kit.timeseries(
            "TURN relayed traffic",
            "Bytes a second relayed, each way (coturn counts an allocation's traffic when it ends, so this "
            "lags the calls by their length).",
            units.BytesPerSecondSI,
            traffic,
            width=10,
        ),
    ]
