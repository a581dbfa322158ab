"""Prometheus rules for WebRTC (``/api/rtc``, issue 22) and the node's TURN relay (coturn).

The runtime's series (``runtime/metrics.py``): ``duplex_rtp_packets_total{outcome}`` (inbound 20 ms Opus
packets: ``received``, ``late`` (came after their slot was concealed), ``concealed`` (slots filled by loss
concealment), ``lost`` (concealed and never came, added when the session ends)), the jitter buffer's depth,
and the POST-to-answer and POST-to-connected histograms (``duplex_rtc_answer_seconds``,
``duplex_rtc_connect_seconds``). coturn's, from its own exporter (``src/apps/relay/prom_server.c`` of
coturn 4.6.3, the image Compose nodes and the regions run; Debian's package has none):
``turn_total_allocations{type}`` (a gauge) and ``turn_total_traffic_{rcv,sent}{p,b}`` (counters, added when
an allocation ends).

Alerts, each with its runbook in the description (docs/operations.md, "Alerts"):

- ``RtpLossHigh`` (ticket): more than ``RTP_CONCEALED_ALERT_FRACTION`` of the inbound 20 ms slots concealed
  (lost or late) over 5 m, with at least ``RTP_ALERT_MIN_PACKETS_PER_S`` packets a second coming in (two
  calls: one caller's bad Wi-Fi is not the node's problem), for 10 m. It reads ``concealed``, counted as it
  happens, rather than ``lost``, counted when each session ends.
- ``RtcConnectSlow`` (ticket): p99 POST-to-connected over 10 m above ``RTC_CONNECT_P99_ALERT_S`` (1 s, issue
  22's goal through the relay), for 10 m.
- ``RtcCallsNotConnecting`` (ticket): more than ``RTC_UNCONNECTED_ALERT_FRACTION`` of the calls answered in
  10 m never connected (ICE or DTLS failed: the browser falls back to the WebSocket), with at least
  ``RTC_ALERT_MIN_ANSWERS`` answers in those 10 m, for 5 m.
- ``TurnRelayDown`` (page; only where coturn's exporter is scraped): coturn's ``up`` 0 or missing for 2 m.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from infra.node.monitoring.promql import (
    AlertSpec,
    RuleTestKit,
    Series,
    bucket_quantile,
    num,
    rate_per_s,
    sel,
    series,
)
from infra.node.profile.profiles import NodeProfile

__all__ = [
    "RTC_ALERT_MIN_ANSWERS",
    "RTC_CONNECT_P99_ALERT_S",
    "RTC_UNCONNECTED_ALERT_FRACTION",
    "RTC_WINDOW",
    "RTP_ALERT_MIN_PACKETS_PER_S",
    "RTP_CONCEALED_ALERT_FRACTION",
    "coturn_exported",
    "rtc_alert_specs",
    "rtc_expression_tests",
    "rtc_healthy_series",
    "rtc_recording_rules",
    "rtc_test_groups",
    "turn_alert_specs",
    "turn_healthy_series",
    "turn_test_groups",
]

RTP_CONCEALED_ALERT_FRACTION = 0.05
"""``RtpLossHigh`` fires above this share (0..1) of inbound 20 ms slots concealed. The jitter buffer
conceals a lone lost packet with Opus PLC; at 5 % the model hears one concealed slot in twenty."""
RTP_ALERT_MIN_PACKETS_PER_S = 100.0
"""``RtpLossHigh`` needs this many inbound packets per second on the target: two calls (50 packets/s
each, 20 ms packets)."""
RTC_CONNECT_P99_ALERT_S = 1.0
"""``RtcConnectSlow`` fires above this p99 POST-to-connected (s): issue 22's goal through the relay."""
RTC_UNCONNECTED_ALERT_FRACTION = 0.25
"""``RtcCallsNotConnecting`` fires above this share (0..1) of answered calls that never connect."""
RTC_ALERT_MIN_ANSWERS = 10
"""``RtcCallsNotConnecting`` needs at least this many answers in ``RTC_WINDOW``."""

RTC_WINDOW = "10m"
_RTC_WINDOW_MIN = 10
_RTP_WINDOW = "5m"
_RTP_WINDOW_MIN = 5
_RTP = "duplex_rtp_packets_total"


def coturn_exported(profile: NodeProfile) -> bool:
    """Whether the node runs coturn with its Prometheus exporter: the relay on, in a ``compose`` node (the
    coturn/coturn image); the local node's Debian coturn is built without one."""
    return profile.relay.enabled and profile.deployment == "compose"


def _rtp(runtime: str, outcomes: str, window: str) -> str:
    """``sum without (outcome) (rate(duplex_rtp_packets_total{runtime, outcome=~outcomes}[window]))``."""
    matcher = f'outcome=~"{outcomes}"'
    return f"sum without (outcome) (rate({_RTP}{sel(runtime, matcher)}[{window}]))"


def _concealed_ratio(runtime: str) -> str:
    """Concealed slots / slots played (received - late + concealed), over 5 m."""
    w = _RTP_WINDOW
    return (
        f"{_rtp(runtime, 'concealed', w)} / "
        f"({_rtp(runtime, 'received|concealed', w)} - {_rtp(runtime, 'late', w)})"
    )


def _unconnected_ratio(runtime: str) -> str:
    """Answered calls that did not connect / answered calls, over ``RTC_WINDOW``."""
    w = RTC_WINDOW
    answers = f"rate(duplex_rtc_answer_seconds_count{sel(runtime)}[{w}])"
    connects = f"rate(duplex_rtc_connect_seconds_count{sel(runtime)}[{w}])"
    return f"({answers} - {connects}) / {answers}"


def rtc_recording_rules(runtime: str) -> list[dict[str, str]]:
    """Per runtime target (``runtime``: normalised matchers without braces): the concealed share over 5 m,
    the loss fraction over 10 m (RFC 3550's: lost / (received + lost)), the unconnected share of answered
    calls over 10 m, and p50/p99 POST-to-answer and POST-to-connected over 5 m."""
    w = RTC_WINDOW
    rules = [
        {"record": "duplex:rtp_concealed:ratio_rate5m", "expr": _concealed_ratio(runtime)},
        {
            "record": f"duplex:rtp_lost:ratio_rate{w}",
            "expr": f"{_rtp(runtime, 'lost', w)} / {_rtp(runtime, 'received|lost', w)}",
        },
        {"record": f"duplex:rtc_unconnected:ratio_rate{w}", "expr": _unconnected_ratio(runtime)},
    ]
    for metric in ("rtc_answer_seconds", "rtc_connect_seconds"):
        for name, q in (("p50", "0.5"), ("p99", "0.99")):
            rules.append(
                {
                    "record": f"duplex:{metric}:{name}_5m",
                    "expr": f"histogram_quantile({q}, rate(duplex_{metric}_bucket{sel(runtime)}[5m]))",
                }
            )
    return rules


def rtc_alert_specs(runtime: str) -> list[AlertSpec]:
    """``RtpLossHigh``, ``RtcConnectSlow`` and ``RtcCallsNotConnecting`` (module docstring) for the runtime
    targets ``runtime`` (normalised matchers without braces)."""
    where = "on {{ $labels.instance }} (node {{ $labels.node }})"
    connect = f"histogram_quantile(0.99, rate(duplex_rtc_connect_seconds_bucket{sel(runtime)}[{RTC_WINDOW}]))"
    answers = f"increase(duplex_rtc_answer_seconds_count{sel(runtime)}[{RTC_WINDOW}])"
    return [
        AlertSpec(
            "RtpLossHigh",
            f"{_concealed_ratio(runtime)} > {num(RTP_CONCEALED_ALERT_FRACTION)} "
            f"and {_rtp(runtime, 'received', _RTP_WINDOW)} >= {num(RTP_ALERT_MIN_PACKETS_PER_S)}",
            "10m",
            "ticket",
            "WebRTC callers' audio is being concealed " + where,
            "{{ $value | humanizePercentage }} of the inbound 20 ms audio slots of WebRTC sessions "
            f"{where} were concealed (the packet was lost or came late) over the last 5 minutes, for 10 "
            f"minutes (threshold {num(RTP_CONCEALED_ALERT_FRACTION * 100)}%): the model hears gaps. Loss "
            "on many callers at once is on the node's side: the uplink, the TURN relay (coturn's traffic "
            "panel) or a saturated host (node-exporter); on the dashboard's WebRTC row, a growing 'late' "
            "rate is jitter rather than loss.",
        ),
        AlertSpec(
            "RtcConnectSlow",
            f"{connect} > {num(RTC_CONNECT_P99_ALERT_S)}",
            "10m",
            "ticket",
            "WebRTC calls take long to connect " + where,
            "The p99 time from a WebRTC offer's POST to its peer connection connected (ICE and DTLS) was "
            "{{ $value | humanizeDuration }} over the last 10 minutes " + where + ", for 10 minutes "
            f"(threshold {num(RTC_CONNECT_P99_ALERT_S * 1000)} ms, through the relay). Look at the TURN "
            "relay's load and address (coturn), and whether callers reach its UDP port or fall back to TLS.",
        ),
        AlertSpec(
            "RtcCallsNotConnecting",
            f"{_unconnected_ratio(runtime)} > {num(RTC_UNCONNECTED_ALERT_FRACTION)} "
            f"and {answers} >= {RTC_ALERT_MIN_ANSWERS}",
            "5m",
            "ticket",
            "WebRTC calls answered but not connecting " + where,
            "{{ $value | humanizePercentage }} of the WebRTC calls answered in the last 10 minutes "
            + where
            + " never connected (ICE or DTLS failed, or no connection within DUPLEX_RTC_CONNECT_TIMEOUT_S), "
            f"for 5 minutes (threshold {num(RTC_UNCONNECTED_ALERT_FRACTION * 100)}%). Browsers fall back to "
            "the WebSocket after 3 s, so calls go on, later and over TCP. Check that the TURN relay is up "
            "and reachable on its public address (3478/udp, 5349/tcp), its certificate, and the TURN URLs "
            "the runtime hands out (DUPLEX_TURN_URLS).",
        ),
    ]


def turn_alert_specs(coturn: str) -> list[AlertSpec]:
    """``TurnRelayDown`` for coturn's exporter targets ``coturn`` (normalised matchers without braces)."""
    up = f"up{sel(coturn)}"
    return [
        AlertSpec(
            "TurnRelayDown",
            f"{up} == 0 or absent({up})",
            "2m",
            "page",
            "TURN relay {{ $labels.instance }} is down",
            "Prometheus has failed to scrape the TURN relay (coturn) '{{ $labels.instance }}' (node "
            "{{ $labels.node }}), or has no coturn target at all, for 2 minutes. WebRTC media reaches the "
            "runtime only through the relay, so new WebRTC calls fail and browsers fall back to the "
            "WebSocket after 3 s. Check the coturn container or pod and its log.",
        )
    ]


# --- promtool unit tests ---------------------------------------------------------------------------------

_PER_MIN = 6000.0  # inbound packets a minute in the tests: 100 a second, the alert's floor
_CONNECT_BUCKETS = (0.75, 1.0, 2.0)  # upper bounds around the 1 s threshold; the runtime's include them


def rtc_healthy_series(kit: RuleTestKit, rt: Mapping[str, str]) -> list[Series]:
    """A healthy node's WebRTC series for runtime target labels ``rt``: 100 packets/s with 4.8 % of the
    slots concealed, p99 connect just under 1 s, 20 % of answered calls not connecting."""
    return [
        (_RTP, {**rt, "outcome": "received"}, kit.counter(_PER_MIN)),
        (_RTP, {**rt, "outcome": "late"}, kit.counter(60)),
        (_RTP, {**rt, "outcome": "concealed"}, kit.counter(300)),
        (_RTP, {**rt, "outcome": "lost"}, kit.counter(240)),
        *_connect_buckets(kit, rt, slow=False),
        ("duplex_rtc_answer_seconds_count", rt, kit.counter(10)),
        ("duplex_rtc_connect_seconds_count", rt, kit.counter(8)),
    ]


def _connect_buckets(kit: RuleTestKit, rt: Mapping[str, str], slow: bool) -> list[Series]:
    """8 connects a minute (the healthy count), all in (0.75, 1] s; ``slow``: one of them in (1, 2] s (a
    slow tail: the p99 is over 1 s, the p50 is not)."""
    low, mid, high = _CONNECT_BUCKETS
    bucket = "duplex_rtc_connect_seconds_bucket"
    return [
        (bucket, {**rt, "le": num(low)}, kit.counter(0)),
        (bucket, {**rt, "le": num(mid)}, kit.counter(7 if slow else 8)),
        (bucket, {**rt, "le": num(high)}, kit.counter(8)),
        (bucket, {**rt, "le": "+Inf"}, kit.counter(8)),
    ]


def rtc_test_groups(kit: RuleTestKit, healthy: list[Series], rt: Mapping[str, str]) -> list[dict[str, Any]]:
    """For each WebRTC alert, a group where it fires (exact labels and annotations) on ``healthy`` with one
    thing made bad, silent before its ``for``; and groups where a bad ratio on too little traffic is quiet.
    The healthy group checks the recorded ratios."""
    late, check, expect, group, with_series = kit.late, kit.check, kit.expect, kit.group, kit.with_series

    def rate(per_min: float, window_min: int) -> float:
        return rate_per_s(per_min, late, window_min)

    concealing = with_series(healthy, _RTP, {**rt, "outcome": "concealed"}, kit.counter(900))
    concealed = rate(900, 5) / (rate(_PER_MIN, 5) + rate(900, 5) - rate(60, 5))
    quiet = with_series(concealing, _RTP, {**rt, "outcome": "received"}, kit.counter(_PER_MIN / 2))
    slow = [s for s in healthy if s[0] != "duplex_rtc_connect_seconds_bucket"] + _connect_buckets(
        kit, rt, True
    )
    r = rate(8, _RTC_WINDOW_MIN)
    slow_p99 = bucket_quantile(0.99, [(0.75, 0.0), (1.0, rate(7, _RTC_WINDOW_MIN)), (2.0, r), (math.inf, r)])
    failing = with_series(healthy, "duplex_rtc_connect_seconds_count", rt, kit.counter(4))
    unconnected = (rate(10, _RTC_WINDOW_MIN) - rate(4, _RTC_WINDOW_MIN)) / rate(10, _RTC_WINDOW_MIN)
    few = with_series(failing, "duplex_rtc_answer_seconds_count", rt, kit.counter(0.9))
    few = with_series(few, "duplex_rtc_connect_seconds_count", rt, kit.counter(0))
    return [
        group(
            f"RtpLossHigh: {concealed:.1%} of the slots concealed",
            concealing,
            check("RtpLossHigh", 5),
            check("RtpLossHigh", late, expect("RtpLossHigh", rt, concealed)),
        ),
        group(
            "RtpLossHigh: a worse share on one call's packets (50 a second) is quiet",
            quiet,
            check("RtpLossHigh", late),
        ),
        group(
            "RtcConnectSlow: one connect in eight between 1 and 2 s",
            slow,
            check("RtcConnectSlow", 5),
            check("RtcConnectSlow", late, expect("RtcConnectSlow", rt, slow_p99)),
        ),
        group(
            "RtcCallsNotConnecting: 60 % of answered calls never connect",
            failing,
            check("RtcCallsNotConnecting", 3),
            check("RtcCallsNotConnecting", late, expect("RtcCallsNotConnecting", rt, unconnected)),
        ),
        group(
            "RtcCallsNotConnecting: none connect, but only 9 answers in 10 minutes",
            few,
            check("RtcCallsNotConnecting", late),
        ),
    ]


def rtc_expression_tests(kit: RuleTestKit, rt: Mapping[str, str]) -> list[dict[str, Any]]:
    """``promql_expr_test`` cases for the healthy group: the recorded concealed, lost and unconnected
    ratios of ``rtc_healthy_series``, computed here as Prometheus computes them."""
    late = kit.late

    def rate(per_min: float, window_min: int) -> float:
        return rate_per_s(per_min, late, window_min)

    expected = {
        "duplex:rtp_concealed:ratio_rate5m": rate(300, 5) / (rate(_PER_MIN, 5) + rate(300, 5) - rate(60, 5)),
        f"duplex:rtp_lost:ratio_rate{RTC_WINDOW}": rate(240, 10) / (rate(_PER_MIN, 10) + rate(240, 10)),
        f"duplex:rtc_unconnected:ratio_rate{RTC_WINDOW}": (rate(10, 10) - rate(8, 10)) / rate(10, 10),
    }
    return [
        {"expr": record, "eval_time": f"{late}m", "exp_samples": [{"labels": series(record, rt), "value": v}]}
        for record, v in expected.items()
    ]


def turn_healthy_series(kit: RuleTestKit, tu: Mapping[str, str]) -> list[Series]:
    """A healthy TURN relay for coturn's target labels ``tu``: scraped."""
    return [("up", tu, kit.steady(1))]


def turn_test_groups(
    kit: RuleTestKit, healthy: list[Series], tu: Mapping[str, str], absent_labels: Mapping[str, str]
) -> list[dict[str, Any]]:
    """``TurnRelayDown`` firing on a failing scrape (labels ``tu``) and on a missing target (the selector's
    equality labels ``absent_labels``), silent before its 2 minutes."""
    late, check, expect, group = kit.late, kit.check, kit.expect, kit.group
    return [
        group(
            "TurnRelayDown: coturn's scrape failing",
            kit.with_series(healthy, "up", tu, kit.steady(0)),
            check("TurnRelayDown", 1),
            check("TurnRelayDown", late, expect("TurnRelayDown", tu, 0)),
        ),
        group(
            "TurnRelayDown: no coturn target",
            kit.without(healthy, "up", tu),
            check("TurnRelayDown", late, expect("TurnRelayDown", absent_labels, 1)),
        ),
    ]
