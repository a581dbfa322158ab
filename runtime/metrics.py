"""Prometheus metrics of the runtime (``prometheus_client``), on a registry of their own.

With ``duplex serve --workers N`` the node is several processes (the engine and N front-end workers):
each has its own :class:`RuntimeMetrics`, and prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, set by ``runtime.multiproc`` before any child starts) keeps their values in
files that any worker's ``/metrics`` adds up: counters and histograms are summed over the processes,
each gauge combined as its ``multiprocess_mode`` says (``livesum``, ``livemax``, ``livemin``: over the
processes still alive).

Every name starts with ``duplex_``. Alert rules and dashboards (the node issue) read these names: change
one and change them too.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The classic text format 0.0.4, which every Prometheus 2.x parses (prometheus_client's latest is 1.0.0)."""

__all__ = ["ACCESS_REFUSAL_REASONS", "RuntimeMetrics", "PROMETHEUS_CONTENT_TYPE"]

ACCESS_REFUSAL_REASONS = (
    "missing",
    "malformed",
    "expired",
    "not_yet_valid",
    "lifetime_too_long",
    "bad_signature",
    "unknown_key",
    "wrong_audience",
    "lifetime_too_long",
    "revoked",
    "wrong_key_kind",
    "replayed",
    "wrong_token_kind",
    "wrong_tenant",
    "insufficient_scope",
    "persona_not_allowed",
    "origin_not_allowed",
    "replay_check_unavailable",
)
"""Refusals of the access check (``runtime.frontend.gate.tokens.REFUSAL_STATUS``; a test keeps the two equal).
Listed here
so that metrics.py imports nothing beyond prometheus_client."""

# Tick durations around the 80 ms frame budget (seconds).
_TICK_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.12, 0.16, 0.25, 0.5, 1.0)
# First-audio latency: the wait for a tick's phase (0-80 ms), the ticks of the engine's delay (80 ms each),
# one tick's compute and the way out (docs/benchmarks.md, "First-audio latency budget").
_FIRST_AUDIO_BUCKETS_S = (
    0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.18, 0.2, 0.22, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0,
)  # fmt: skip
# The wait for the tick that takes a session's first frame: 0 to one 80 ms frame when the tick keeps time.
_PHASE_WAIT_BUCKETS_S = (0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.16, 0.32)
# A count of ticks, bucketed at k + 0.5 so that histogram_quantile lands within half a tick of the count.
_TICK_COUNT_BUCKETS = (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 8.5, 10.5, 16.5)
# Hand-offs between threads and processes (the ZeroMQ hop, the event loop, the codec): well under a frame.
_HANDOFF_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 1.0)


class RuntimeMetrics:
    """The runtime's metrics. One instance per server; ``registry`` is what ``/metrics`` serves."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.slots_total = Gauge(
            "duplex_slots_total",
            "Batch slots (maximum concurrent sessions)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.active_sessions = Gauge(
            "duplex_active_sessions", "Sessions holding a slot", registry=r, multiprocess_mode="livesum"
        )
        self.draining = Gauge(
            "duplex_draining",
            "1 while the process admits no new session: draining after SIGTERM, or a host maintenance notice",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.ready = Gauge(
            "duplex_ready",
            "1 when /readyz answers 200 (several processes: all of them ready)",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.maintenance_pending = Gauge(
            "duplex_maintenance_pending",
            "1 while a host maintenance notice is pending "
            "(GCE maintenance-event, runtime/frontend/maintenance.py)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.maintenance_watch_errors = Counter(
            "duplex_maintenance_watch_errors_total",
            "Failed requests to the metadata server's maintenance-event key (retried with backoff)",
            registry=r,
        )
        self.deletion_cost_writes = Counter(
            "duplex_deletion_cost_writes_total",
            "Writes of the pod's controller.kubernetes.io/pod-deletion-cost annotation by outcome: written, "
            "refused (4xx: RBAC), failed (5xx, timeout, network); runtime/fleet/deletion_cost.py",
            ["outcome"],
            registry=r,
        )
        self.voice_files_refused = Gauge(
            "duplex_voice_files_refused",
            "Voice files refused at start-up (unreadable, wrong keys or shapes, bad name; each logged with "
            "its reason and listed in /api/personas voices_refused)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.heap_trimmed = Counter(
            "duplex_heap_trimmed_bytes_total",
            "Resident memory given back to the OS by the periodic malloc_trim (runtime/heap_trim.py), bytes",
            registry=r,
        )
        self.heap_trim_duration = Histogram(
            "duplex_heap_trim_seconds",
            "Wall time of one malloc_trim(0) (in a thread: the event loop keeps serving)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
            registry=r,
        )
        self.loading = Gauge(
            "duplex_loading",
            "1 while the model loads and warms up (/readyz 503 'loading')",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.tick_duration = Histogram(
            "duplex_tick_duration_seconds",
            "Wall time of one batched tick (encode, LM step, decode, prompt steps)",
            buckets=_TICK_BUCKETS_S,
            registry=r,
        )
        self.ticks_total = Counter("duplex_ticks_total", "Ticks run with at least one slot busy", registry=r)
        self.ticks_over_budget = Counter(
            "duplex_ticks_over_budget_total",
            "Ticks that took longer than their period (the 80 ms frame; 40 ms with two staggered groups)",
            registry=r,
        )
        self.first_audio_latency = Histogram(
            "duplex_first_audio_latency_seconds",
            "Time from a session's first input frame to its first output frame sent",
            buckets=_FIRST_AUDIO_BUCKETS_S,
            registry=r,
        )
        # The first-audio budget, term by term: observed once per session, with the total above, when its
        # first audio is handed to the socket (docs/benchmarks.md, "First-audio latency budget").
        self.first_audio_ingress = Histogram(
            "duplex_first_audio_ingress_seconds",
            "First audio, term 1: from the front end's first input frame to its arrival at the engine "
            "(the ZeroMQ hop with --workers N; 0 in one process)",
            buckets=_HANDOFF_BUCKETS_S,
            registry=r,
        )
        self.first_audio_phase_wait = Histogram(
            "duplex_first_audio_phase_wait_seconds",
            "First audio, term 2: from the first input frame's arrival at the engine to the start of the "
            "tick that takes it",
            buckets=_PHASE_WAIT_BUCKETS_S,
            registry=r,
        )
        self.first_audio_ticks = Histogram(
            "duplex_first_audio_ticks",
            "First audio, term 3: ticks from the tick that took the first input frame to the tick that "
            "produced the first audio (0: the same tick; 80 ms each)",
            buckets=_TICK_COUNT_BUCKETS,
            registry=r,
        )
        self.first_audio_tick_compute = Histogram(
            "duplex_first_audio_tick_compute_seconds",
            "First audio, term 4: wall time of the tick that produced the first audio",
            buckets=_TICK_BUCKETS_S,
            registry=r,
        )
        self.first_audio_egress = Histogram(
            "duplex_first_audio_egress_seconds",
            "First audio, term 5: from the end of the tick that produced it to the first audio handed to "
            "the socket (event loop, ZeroMQ with --workers N, outbox, encoding)",
            buckets=_HANDOFF_BUCKETS_S,
            registry=r,
        )
        # Persona rollover (runtime/engine/rollover.py; docs/runtime.md, "Long calls: the persona rollover").
        self.persona_rollovers = Counter(
            "duplex_persona_rollovers_total",
            "Live sessions rolled over to a fresh state (persona and the agent's last text re-prefilled), by "
            "trigger: pause (a quiet caller past the seek threshold) or forced (past the force threshold)",
            ["trigger"],
            registry=r,
        )
        self.persona_age = Gauge(
            "duplex_persona_age_steps",
            "Largest, over live sessions with a persona, of the LM steps since the persona's first step "
            "(80 ms each); past the model's context (3000 for the 7B) the persona has left the window",
            registry=r,
            multiprocess_mode="livemax",
        )
        for trigger in ("pause", "forced"):
            self.persona_rollovers.labels(trigger=trigger)
        self.frames_dropped = Counter(
            "duplex_frames_dropped_total",
            "Frames lost: late_input (silence fed instead), input_overflow (client faster than real time), "
            "slow_client (output not read in time), slow_worker (engine to front-end queue full)",
            ["reason"],
            registry=r,
        )
        self.admissions_refused = Counter(
            "duplex_admissions_refused_total",
            "New sessions refused, by reason (a resume's refusals count in duplex_resume_refused_total only)",
            ["reason"],
            registry=r,
        )
        self.sessions_started = Counter("duplex_sessions_started_total", "Sessions admitted", registry=r)
        self.sessions_ended = Counter(
            "duplex_sessions_ended_total", "Sessions ended, by reason", ["reason"], registry=r
        )
        self.protocol_errors = Counter(
            "duplex_protocol_errors_total", "Malformed client input, by reason", ["reason"], registry=r
        )
        self.redis_errors = Counter(
            "duplex_redis_errors_total", "Failed Redis operations, by op", ["op"], registry=r
        )
        self.redis_backlog = Gauge(
            "duplex_redis_backlog_ops",
            "Session-store writes waiting for Redis",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.gpu_memory_allocated = Gauge(
            "duplex_gpu_memory_allocated_bytes",
            "torch.cuda.memory_allocated on the engine's GPU",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.waiting_sessions = Gauge(
            "duplex_waiting_sessions",
            "Callers in the waiting room (all slots taken)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.waiting_room = Counter(
            "duplex_waiting_room_total",
            "Waiting-room outcomes: admitted (got a slot), timeout, left (client gone), full (room full)",
            ["outcome"],
            registry=r,
        )
        self.waiting_room_wait = Histogram(
            "duplex_waiting_room_wait_seconds",
            "Time a caller spent in the waiting room, whatever the outcome",
            buckets=(0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0),
            registry=r,
        )
        # Recordings (runtime/frontend/store/recordings.py; docs/sessions-api.md, "Recording").
        self.recordings = Counter(
            "duplex_recordings_total",
            "Recording files finished (one per side of a consenting session: caller, agent)",
            ["side"],
            registry=r,
        )
        self.recording_bytes = Counter(
            "duplex_recording_bytes_total",
            "Ogg Opus bytes written to recordings, by side",
            ["side"],
            registry=r,
        )
        self.recording_errors = Counter(
            "duplex_recording_errors_total",
            "Recording faults: queue_full (PCM encoder behind: audio left out of the recording), write (disk "
            "error: that side's recording stops)",
            ["reason"],
            registry=r,
        )
        self.recordings_swept = Counter(
            "duplex_recordings_swept_total",
            "Recording files deleted by the retention sweep (older than DUPLEX_TRANSCRIPT_TTL_S)",
            registry=r,
        )
        for side in ("caller", "agent"):
            self.recordings.labels(side=side)
            self.recording_bytes.labels(side=side)
        for reason in ("queue_full", "write"):
            self.recording_errors.labels(reason=reason)
        self._transport_metrics(r)
        self.sessions_detached = Counter(
            "duplex_sessions_detached_total",
            "Resumable sessions whose transport was lost without a normal close: their slot held, paused, "
            "for DUPLEX_RESUME_S",
            registry=r,
        )
        self.sessions_resumed = Counter(
            "duplex_sessions_resumed_total",
            "Sessions resumed with their credential (same slot, same session id), through any worker",
            registry=r,
        )
        self.resume_gap = Histogram(
            "duplex_resume_gap_seconds",
            "A resume's gap: from the session's last input frame before the drop to the resume granted",
            buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0),
            registry=r,
        )
        self.resume_refused = Counter(
            "duplex_resume_refused_total",
            "Resumes refused: resume_off, resume_invalid, resume_replayed, resume_expired, resume_live (a "
            "takeover of a live session tried; and any other "
            "refusal of a connection presenting a resume credential: rate_limited, draining, not_ready...)",
            ["reason"],
            registry=r,
        )
        for reason in ("resume_off", "resume_invalid", "resume_replayed", "resume_expired", "resume_live"):
            self.resume_refused.labels(reason=reason)
        for outcome in ("admitted", "timeout", "left", "full"):
            self.waiting_room.labels(outcome=outcome)
        for reason in ("late_input", "input_overflow", "slow_client", "slow_worker"):
            self.frames_dropped.labels(reason=reason)
        # After the upgrade: node_full, draining, bad_request; before it, the access check's reasons
        # (runtime/frontend/gate/tokens.py REFUSAL_STATUS: missing, malformed, expired, ...,
        # origin_not_allowed).
        for reason in (
            "node_full",
            "waiting_room_full",
            "wait_timeout",
            "rate_limited",
            "draining",
            "bad_request",
            *ACCESS_REFUSAL_REASONS,
        ):
            self.admissions_refused.labels(reason=reason)

    def _transport_metrics(self, r: CollectorRegistry) -> None:
        """Sessions by transport, and WebRTC's own (``/api/rtc``:
        runtime/frontend/transports/webrtc/signalling.py)."""
        self.transport_sessions_started = Counter(
            "duplex_transport_sessions_started_total",
            "Sessions admitted, by transport: websocket (/api/chat), webrtc (/api/rtc) or a phone carrier "
            "(twilio, plivo, telnyx, exotel: /api/carriers/<carrier>)",
            ["transport"],
            registry=r,
        )
        self.transport_sessions_active = Gauge(
            "duplex_transport_sessions_active",
            "Sessions holding a slot, by transport",
            ["transport"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.rtp_packets = Counter(
            "duplex_rtp_packets_total",
            "Inbound RTP audio packets (20 ms each): received; late (came after their slot was concealed: "
            "dropped); concealed (slots filled by Opus loss concealment); lost (concealed, never came; "
            "added when the session ends)",
            ["outcome"],
            registry=r,
        )
        self.rtp_jitter_depth = Histogram(
            "duplex_rtp_jitter_buffer_depth_packets",
            "Packets held in a WebRTC session's jitter buffer after each playout (20 ms each; cap 6)",
            buckets=(0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5),
            registry=r,
        )
        self.rtc_answer = Histogram(
            "duplex_rtc_answer_seconds",
            "WebRTC: from the POST of the offer to the SDP answer ready (admission and ICE gathering)",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
            registry=r,
        )
        self.rtc_connect = Histogram(
            "duplex_rtc_connect_seconds",
            "WebRTC: from the POST of the offer to the peer connection connected (ICE and DTLS done)",
            buckets=(0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 3.0, 5.0, 10.0),
            registry=r,
        )
        self.carrier_barge_ins = Counter(
            "duplex_carrier_barge_ins_total",
            "Phone calls: the caller spoke over the agent's audio queued at the carrier, which was cleared",
            ["carrier"],
            registry=r,
        )
        self.carrier_dtmf = Counter(
            "duplex_carrier_dtmf_total",
            "Phone calls: DTMF digits the carrier reported (each also an event in the session's stream)",
            ["carrier"],
            registry=r,
        )
        for carrier in ("twilio", "plivo", "telnyx", "exotel"):
            self.carrier_barge_ins.labels(carrier=carrier)
            self.carrier_dtmf.labels(carrier=carrier)
        for transport in ("websocket", "webrtc", "twilio", "plivo", "telnyx", "exotel"):
            self.transport_sessions_started.labels(transport=transport)
            self.transport_sessions_active.labels(transport=transport)
        for outcome in ("received", "late", "concealed", "lost"):
            self.rtp_packets.labels(outcome=outcome)

    def refused(self, reason: str, *, resume: bool = False) -> None:
        """Count one refusal, once: a connection that presented a resume credential (``resume``) in
        ``duplex_resume_refused_total``, any other in ``duplex_admissions_refused_total``, whatever the
        reason (``rate_limited``, ``draining``, an access reason... count where the connection belongs)."""
        (self.resume_refused if resume else self.admissions_refused).labels(reason=reason).inc()

    def observe_first_audio(
        self,
        total_s: float,
        *,
        ingress_s: float | None = None,
        phase_wait_s: float | None = None,
        ticks: int | None = None,
        tick_compute_s: float | None = None,
        egress_s: float | None = None,
    ) -> None:
        """One session's first audio: its total latency and, when the engine's timestamps came with it,
        the terms that make it up (total = ingress + phase wait + ticks x 80 ms + tick compute + egress,
        when every tick keeps time). Terms left None are not observed."""
        self.first_audio_latency.observe(total_s)
        for histogram, value in (
            (self.first_audio_ingress, ingress_s),
            (self.first_audio_phase_wait, phase_wait_s),
            (self.first_audio_ticks, ticks),
            (self.first_audio_tick_compute, tick_compute_s),
            (self.first_audio_egress, egress_s),
        ):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        """The Prometheus text exposition of the registry; with ``PROMETHEUS_MULTIPROC_DIR`` set, of every
        process of the node (prometheus_client's ``MultiProcessCollector``)."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=directory)
            return generate_latest(registry)
        return generate_latest(self.registry)
