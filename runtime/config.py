"""The runtime's configuration: one typed object, read from ``DUPLEX_*`` environment variables and the CLI.

Every field is validated when the process starts; a bad value stops it with the variable's name, the
value and what is allowed, before any model is loaded.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from runtime.engine.model_presets import (
    DEFAULT_TEXT_PROMPT,
    DEFAULT_VOICE_PROMPT,
    PRESETS,
    check_preset_name,
)
from runtime.gc_policy import DEFAULT_GC_THRESHOLDS, parse_gc_thresholds

if TYPE_CHECKING:  # runtime.frontend.gate.tokens (PyJWT) is imported when the keys are loaded
    from runtime.engine.models import ModelBundle
    from runtime.signing_keys import SigningKey


class RuntimeConfig(BaseSettings):
    """Settings of one runtime process (one node's model copy and its slots).

    Environment: each field as ``DUPLEX_<FIELD>`` (e.g. ``DUPLEX_MAX_SESSIONS=5``). The Hugging Face
    token is never a field: ``huggingface_hub`` reads ``HF_TOKEN`` itself at load time.
    """

    # hide_input_in_errors: a rejected DUPLEX_TOKEN_KEYS must not be echoed into a log.
    model_config = SettingsConfigDict(env_prefix="DUPLEX_", extra="forbid", hide_input_in_errors=True)

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 inside a container)")
    port: int = Field(8998, ge=0, le=65535, description="WebSocket/HTTP port; 0 picks a free one")
    model: str = Field("tiny", description="Model preset: " + ", ".join(sorted(PRESETS)))
    weights: str | None = Field(None, description="Checkpoint directory or HF repo id; default the preset's")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1 ...")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="LM weight dtype; default float32 on a CPU, bfloat16 on a GPU (use float16 on a T4)"
    )
    quantize: Literal["none", "int8"] = Field(
        "none",
        description="LM weights: none (at the LM dtype) or int8 (moshi's LLM.int8 path through bitsandbytes: "
        "linear layers int8, the rest fp16; Mimi stays fp32). int8 is checked against the device when the "
        "model loads and refused where bitsandbytes' kernels cannot run",
    )
    seed: int = Field(0, ge=0, description="Seed of the tiny preset's random weights")
    prompt_prefill: bool = Field(
        True,
        description="Run a persona's fully forced prompt through the temporal transformer in parallel "
        "chunks (false: one teacher-forced step at a time, the reference path)",
    )
    # Persona rollover (runtime/engine/rollover.py; docs/runtime.md, "Long calls: the persona rollover").
    rollover: bool = Field(
        True,
        description="Roll a live session with a prefilled persona over to a fresh state (persona and the "
        "agent's last text re-prefilled) before the persona leaves the model's attention window",
    )
    rollover_seek_fraction: float = Field(
        0.6,
        gt=0,
        lt=1,
        description="From this fraction of the model's context (steps since the persona began; 0.6 = 1800 "
        "steps, 2.4 min on the 7B) a session rolls over at the caller's first pause",
    )
    rollover_force_fraction: float = Field(
        0.85,
        gt=0,
        lt=1,
        description="From this fraction of the context (0.85 = 2550 steps, 3.4 min on the 7B) a session "
        "rolls over whatever the caller does; >= DUPLEX_ROLLOVER_SEEK_FRACTION",
    )
    rollover_memory_tokens: int = Field(
        64,
        ge=0,
        le=4096,
        description="Agent text tokens (the last ones, padding left out) fed after the persona",
    )
    rollover_pause_ticks: int = Field(
        6, ge=1, le=1000, description="Quiet input frames in a row (80 ms each) that make a caller pause"
    )
    rollover_pause_rms: float = Field(
        0.01,
        ge=0,
        le=1,
        description="RMS (full scale 1.0) below which an input frame is quiet (0.01 = -40 dBFS)",
    )
    max_sessions: int = Field(5, ge=1, le=256, description="Batch slots B = concurrent sessions")
    stagger_groups: int = Field(
        1,
        ge=1,
        le=2,
        description="Staggered sub-batches (issue 24): 2 steps the sessions in two groups 40 ms apart, each "
        "caller joining the group whose tick comes first (phase wait 0-40 ms instead of 0-80 ms), at the "
        "cost of a whole-batch step every 40 ms; 1 steps every session in one tick per 80 ms frame. Turn on "
        "only where `duplex capacity --stagger-groups 2` says the node keeps its margin (docs/capacity.md)",
    )
    node_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=128)
    # Resume across pods and regions (runtime.region_routes.py; docs/deploying.md, "Resume across
    # regions"): all three set, a resumable session's metadata names a URL that reaches this pod again.
    region: str | None = Field(
        None,
        pattern=r"^[a-z][a-z0-9-]{0,62}$",
        description="The region this node serves in (multi-region: the GCP region, e.g. us-central1); with "
        "DUPLEX_PUBLIC_URL and DUPLEX_POD_IP the resume metadata gets resume_url and the ICE-servers answer "
        "offer_url; unset: neither (single nodes)",
    )
    public_url: str | None = Field(
        None,
        description="The stack's public base URL, https://<domain>[:port] with no path (multi-region: the "
        "global entry's); resume_url and offer_url are built on it",
    )
    pod_ip: str | None = Field(
        None,
        description="This pod's IPv4 address (Kubernetes' downward API, status.podIP): its dashed form "
        "names the pod in resume_url, as the resume router's headless-Service DNS name does",
    )
    redis_url: str | None = Field(
        None, description="redis://[:password@]host:port/db; None disables the store"
    )
    transcript_ttl_s: int = Field(
        86400,
        ge=60,
        description="Redis TTL (s) of a session's record and transcript, refreshed at each write",
    )
    recording_dir: Path | None = Field(
        None,
        description="Directory of session recordings (both sides as Ogg Opus, only for session tokens with "
        "recording_consent); None: nothing is recorded. Files older than transcript_ttl_s are swept",
    )
    recording_sweep_s: float = Field(
        300.0, gt=0, le=86400, description="How often expired recordings are looked for and deleted (s)"
    )
    events_maxlen: int = Field(
        100_000,
        ge=0,
        description="Approximate length cap of the Redis session events stream {prefix}:events "
        "(XADD MAXLEN ~); 0 writes no events",
    )
    erase_aof_rewrite_s: float = Field(
        300.0,
        ge=0,
        le=86400,
        description="Least time (s) between two Redis AOF rewrites (BGREWRITEAOF) asked after session erases "
        "(DELETE /api/sessions/<id>), so erased text leaves Redis's files; an erase within the window gets "
        "its rewrite at the window's end; 0: after every erase (docs/sessions-api.md, Endpoints)",
    )
    aof_rewrite_every_s: float = Field(
        86400.0,
        ge=0,
        le=7 * 86400,
        description="Period (s) of the Redis AOF rewrite (BGREWRITEAOF) the session store asks on its own, "
        "so that keys expired by the retention leave Redis's append-only file within it even on a quiet "
        "node; the first a period after start; 0: never (docs/sessions-api.md, Endpoints)",
    )
    voices_dir: Path | None = Field(None, description="Directory of voice prompts (*.wav, *.pt)")
    default_voice: str = Field(
        DEFAULT_VOICE_PROMPT,
        min_length=1,
        max_length=64,
        description="Voice of a session that names none, on a model that always runs one (personaplex-7b; "
        "NVIDIA's server always runs a voice prompt); sessions without a voice are refused if the catalog "
        "lacks it",
    )
    default_text_prompt: str = Field(
        DEFAULT_TEXT_PROMPT,
        min_length=1,
        max_length=4000,
        description="Text prompt of a session that gives none, on a model that always runs one "
        "(personaplex-7b): NVIDIA's default (its offline.py and web client)",
    )
    drain_grace_s: float = Field(30.0, ge=0, description="After SIGTERM, how long running sessions may go on")
    max_session_s: float = Field(3600.0, gt=0, description="Longest session; it is closed after this")
    resume_s: float = Field(
        10.0,
        ge=0,
        le=600,
        description="How long a resumable session's slot is held, paused, after its transport was lost "
        "without a normal close (s); 0 turns resume off",
    )
    max_message_bytes: int = Field(65536, ge=1024, description="Largest client WebSocket message")
    max_inbox_frames: int = Field(8, ge=1, description="Input frames buffered per session (8 = 640 ms)")
    max_outbox_frames: int = Field(
        25, ge=1, description="Output frames queued per session before drops (2 s)"
    )
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads; default torch's")
    # Opus encoding (runtime/frontend/codecs/kyutai_audio.py; figures: python -m runtime.tools.codec_bench,
    # docs/benchmarks.md).
    opus_encoder: Literal["sphn", "pyav"] = Field(
        "sphn",
        description="Outbound Opus encoder: sphn (libopus complexity 10, holds the GIL) or pyav (PyAV's "
        "libopus at DUPLEX_OPUS_COMPLEXITY, releases the GIL); same Ogg/Opus stream shape, sphn decodes",
    )
    opus_complexity: int = Field(
        10,
        ge=0,
        le=10,
        description="libopus complexity of the pyav encoder: 10 (libopus' default) .. 0 (cheapest); "
        "sphn supports 10 only",
    )
    # Access control (runtime/frontend/gate/tokens.py, docs/protocol.md, "Access control").
    auth_mode: Literal["token", "off"] = Field(
        "token",
        description="token: a session needs a signed session token; off: anyone reaching the port may "
        "open one (tests, a private demo)",
    )
    token_keys: SecretStr | None = Field(
        None,
        description='Session-token signing keys as JSON {"kid": "secret", ...} (secrets >= 32 bytes; '
        '{"kid": {"secret": ..., "tenant": ...}} binds a key to a tenant)',
    )
    token_keys_file: Path | None = Field(None, description="File holding the signing keys' JSON instead")
    app_token_keys: SecretStr | None = Field(
        None,
        description="Application-token (sessions API) signing keys, JSON as DUPLEX_TOKEN_KEYS; no kid may "
        "be in both. Unset: the sessions API is off unless DUPLEX_APP_TOKENS_USE_SESSION_KEYS=true",
    )
    app_token_keys_file: Path | None = Field(
        None, description="File holding the application-token keys' JSON instead"
    )
    app_tokens_use_session_keys: bool = Field(
        False,
        description="Deprecated: verify application tokens with the session-token keys (as before the two "
        "kinds had keys of their own); logged as a warning. Only without DUPLEX_APP_TOKEN_KEYS",
    )
    token_max_ttl_s: float = Field(
        86400.0,
        gt=0,
        le=86400,
        description="Longest session-token lifetime accepted (s): exp - iat and exp - now (24 h at most)",
    )
    app_token_max_ttl_s: float = Field(
        86400.0,
        gt=0,
        le=86400,
        description="Longest application-token lifetime accepted (s): exp - iat and exp - now (24 h at most)",
    )
    token_revoked_jtis: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Revoked token ids (jti), refused as revoked (comma-separated or JSON)",
    )
    token_revoked_kids: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Revoked key ids: every token they signed is refused (comma-separated or JSON)",
    )
    token_audience: str = Field(
        "duplex", min_length=1, max_length=256, description="The aud claim tokens must carry"
    )
    token_leeway_s: float = Field(5.0, ge=0, le=300, description="Clock skew tolerated on exp/nbf/iat (s)")
    token_replay_check: Literal["redis", "redis-or-memory", "memory", "off"] = Field(
        "redis",
        description="Where used token ids are kept: redis (refuse when Redis is down), redis-or-memory "
        "(fall back to this process's memory when Redis is down), memory (this process only), off",
    )
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Browser origins allowed to open sessions (scheme://host[:port], comma-separated or "
        'JSON; "*" for any); requests without an Origin header are not affected',
    )
    # The front end's own protections (runtime/frontend/gate/ratelimit.py, runtime/frontend/server.py; issue
    # 16).
    handshake_rate_per_client: float = Field(
        20.0, ge=0, description="WebSocket upgrades per second per client address (0: no limit); 429 past it"
    )
    handshake_burst_per_client: int = Field(60, ge=1, description="Per-client bucket size (upgrades at once)")
    handshake_rate_global: float = Field(
        200.0, ge=0, description="WebSocket upgrades per second for the whole node (0: no limit); 429 past it"
    )
    handshake_burst_global: int = Field(400, ge=1, description="Global bucket size (upgrades at once)")
    trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.0/8", "::1/128"],
        description="CIDRs whose X-Real-IP / X-Forwarded-For name the client (comma-separated); default "
        "loopback only (the node's nginx): name a load balancer's ranges to believe it",
    )
    forwarded_by: Literal["nginx", "google-lb"] = Field(
        "nginx",
        description="Who sets the client's address when the peer is a trusted proxy: nginx (its X-Real-IP, "
        "else X-Forwarded-For's right-most untrusted hop) or google-lb (a Google Cloud load balancer: "
        "X-Forwarded-For's second-to-last entry, the one the front end appended; X-Real-IP is a client's "
        "header then and is ignored)",
    )
    url_secrets: Literal["allow", "refuse"] = Field(
        "allow",
        description="refuse: a session request whose URL carries token=, resume= or text_prompt= is refused "
        "400 bad_request naming where each goes instead (a header, a subprotocol, the first message), for "
        "deployments whose load balancer logs full URLs (GKE's: Cloud Logging; issue 34, item 9); allow: "
        "accepted, as older clients send them",
    )
    metrics_cache_s: float = Field(
        1.0, ge=0, le=60, description="/metrics reuses its last rendering for this long (0: render each time)"
    )
    waiting_room_s: float = Field(
        0.0, ge=0, le=3600, description="How long a caller may wait for a slot when all are taken (0: refuse)"
    )
    waiting_room_size: int = Field(0, ge=0, le=4096, description="Callers that may wait at once (0: none)")
    waiting_room_per_client: int = Field(
        2,
        ge=0,
        le=4096,
        description="Callers from one client address that may wait at once (0: no cap): one address "
        "cannot fill the waiting room",
    )
    full_before_upgrade: bool = Field(
        False,
        description="true: a /api/chat upgrade that finds no free slot and no waiting-room place is answered "
        "503 node_full with Retry-After before the upgrade, so a load balancer's retry policy sends it to "
        "another pod (the multi-region stack's global entry; issue 33); false: upgraded, then refused with "
        "a 0x05 naming the reason and close code 1013, which a browser can read (a single node)",
    )
    workers: int = Field(
        0,
        ge=-1,
        le=64,
        description="Front-end worker processes beside the engine process (runtime/multiproc.py): 0 runs "
        "one process (model and front end together), -1 picks from the host's cores (one per core, 1..8)",
    )
    # The runtime's own HTTP listener (runtime/frontend/http.py; issue 34, item 10: on GKE callers reach the
    # pods without nginx, so slow and silent connections must be cut here).
    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="A connection that has not sent a whole request line and headers this long after it "
        "opened is closed (s; checked every quarter of it, so closed within 1.5 times it)",
    )
    http_body_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="A POST /api/rtc whose SDP offer body has not fully arrived this long after its headers "
        "is answered 408 and closed (s)",
    )
    http_idle_timeout_s: float = Field(
        75.0,
        gt=0,
        le=3600,
        description="An idle keep-alive connection (between requests) is closed after this (s; aiohttp's "
        "keepalive_timeout, nginx's default); a WebSocket is not idle: its heartbeat runs",
    )
    # WebRTC media relay (runtime/frontend/transports/webrtc/turn.py; the node runs coturn with the same
    # secret).
    turn_secret: SecretStr | None = Field(
        None,
        description="coturn's static-auth-secret (>= 32 bytes): TURN credentials are minted per session from "
        "it (the TURN REST scheme); None: callers get no relay",
    )
    turn_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="TURN/STUN URLs given to WebRTC callers, comma-separated (e.g. "
        "turn:node.example.com:3478?transport=udp,turns:node.example.com:5349?transport=tcp)",
    )
    turn_ttl_s: int = Field(
        3600, ge=60, le=86400, description="How long a session's TURN credentials are valid (s)"
    )
    # Phone carriers' media streams (runtime/frontend/transports/carriers/; docs/deploying.md, "Phone
    # numbers"): each bridge is off until its secret is set.
    twilio_auth_token: SecretStr | None = Field(
        None,
        description="Twilio account auth token: X-Twilio-Signature on /api/carriers/twilio is checked with "
        "it; unset: the Twilio bridge answers 404",
    )
    twilio_auth_token_file: Path | None = Field(
        None, description="File holding the Twilio auth token instead"
    )
    twilio_stream_url: str | None = Field(
        None,
        description="The wss:// URL your TwiML's <Stream url=...> names (what Twilio signs), e.g. "
        "wss://voice.example.com/api/carriers/twilio; required with the auth token",
    )
    plivo_auth_token: SecretStr | None = Field(
        None,
        description="Plivo account (or subaccount) auth token: X-Plivo-Signature-V3 on /api/carriers/plivo "
        "is checked with it; unset: the Plivo bridge answers 404",
    )
    plivo_auth_token_file: Path | None = Field(None, description="File holding the Plivo auth token instead")
    exotel_api_key: str | None = Field(
        None,
        description="Exotel API key: the user of the Basic auth Exotel sends on /api/carriers/exotel's "
        "upgrade (wss://<key>:<token>@host/...); unset: the Exotel bridge answers 404",
    )
    exotel_api_token: SecretStr | None = Field(
        None, description="Exotel API token: the Basic auth's password"
    )
    exotel_api_token_file: Path | None = Field(None, description="File holding the Exotel API token instead")
    exotel_personas: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Voice prompts an Exotel call may name, comma-separated (* for any); an Exotel call "
        "carries no session token (its stream URL's parameters are 256 characters at most), so the bridge "
        "admits on the account's Basic auth and this list is its persona policy. Empty: only the node's "
        "default voice",
    )
    telnyx_stream_token: SecretStr | None = Field(
        None,
        description="A secret the Telnyx stream URL carries (?stream_token=..., or Authorization: Bearer): "
        "Telnyx signs no stream upgrade, so /api/carriers/telnyx admits on it; unset: the Telnyx bridge "
        "answers 404",
    )
    telnyx_stream_token_file: Path | None = Field(
        None, description="File holding the Telnyx stream secret instead"
    )
    plivo_stream_url: str | None = Field(
        None,
        description="The wss:// URL your Plivo XML's <Stream> names, without its query string (the "
        "signature covers it and the query the call comes with), e.g. "
        "wss://voice.example.com/api/carriers/plivo; required with the auth token",
    )
    # WebRTC sessions on /api/rtc (runtime/frontend/transports/webrtc/signalling.py): when a peer that went
    # away frees its slot.
    rtc_connect_timeout_s: float = Field(
        10.0,
        gt=0,
        le=120,
        description="A WebRTC session whose ICE/DTLS has not connected this long after its answer ends (s)",
    )
    rtc_media_timeout_s: float = Field(
        5.0,
        gt=0,
        le=120,
        description="A connected WebRTC session with no RTP from its peer for this long ends (s): the peer "
        "vanished without a DTLS close (a closed laptop, a lost network)",
    )
    # A caller's ICE candidates (runtime/frontend/transports/webrtc/candidates.py): where the node's ICE
    # agent may send STUN checks. Default: globally routable addresses only.
    rtc_allowed_candidate_nets: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="CIDRs (comma-separated) a WebRTC caller's ICE candidates may name beyond globally "
        "routable addresses: a deployment's own private nets, loopback for a node on one host; empty: none",
    )
    rtc_relay_nets: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="CIDRs (comma-separated) of the node's own TURN relay addresses: a caller's typ relay "
        "candidates there are kept (a Compose node's coturn has a private address)",
    )
    rtc_relay_only: bool = Field(
        False,
        description="Keep only a caller's typ relay candidates inside DUPLEX_RTC_RELAY_NETS (callers reach "
        "the node through its TURN relay only)",
    )
    gc_thresholds: str = Field(
        DEFAULT_GC_THRESHOLDS,
        description="Python's garbage collector in a serving process (runtime/gc_policy.py): gen0,gen1,gen2 "
        'thresholds after start-up objects are frozen, or "default" for Python\'s own (700,10,10)',
    )
    malloc_trim_s: float = Field(
        60.0,
        ge=0,
        le=86400,
        description="Every this many seconds a serving process gives the C heap's free memory back to the OS "
        "(glibc malloc_trim: runtime/heap_trim.py); 0: never",
    )
    sim_step_ms: str = Field(
        "30",
        description='model=sim only: step time, ms ("30") or batch:ms pairs ("1:28,8:32.6,16:45,32:70.2")',
    )

    @field_validator("gc_thresholds")
    @classmethod
    def _gc_thresholds(cls, value: str) -> str:
        parse_gc_thresholds(value)  # ValueError naming what is allowed
        return value

    @field_validator("sim_step_ms")
    @classmethod
    def _sim_step(cls, value: str) -> str:
        from runtime.engine.sim_timing import parse_step_time

        parse_step_time(value)
        return value

    @field_validator("trusted_proxies", "rtc_allowed_candidate_nets", "rtc_relay_nets", mode="before")
    @classmethod
    def _cidr_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("trusted_proxies", "rtc_allowed_candidate_nets", "rtc_relay_nets")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        import ipaddress

        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an address or CIDR (e.g. 10.0.0.0/8 or ::1/128)") from None
        return value

    @model_validator(mode="after")
    def _relay_only_needs_relay_nets(self) -> RuntimeConfig:
        if self.rtc_relay_only and not self.rtc_relay_nets:
            raise ValueError(
                "DUPLEX_RTC_RELAY_ONLY=true needs DUPLEX_RTC_RELAY_NETS: the TURN relay's addresses whose "
                "relay candidates are kept (else no candidate is)"
            )
        return self

    @model_validator(mode="after")
    def _twilio_needs_its_url(self) -> RuntimeConfig:
        _carrier_settings_paired(
            "Twilio", "TWILIO", self.twilio_auth_token, self.twilio_auth_token_file, self.twilio_stream_url
        )
        return self

    @model_validator(mode="after")
    def _exotel_key_and_token(self) -> RuntimeConfig:
        if self.exotel_api_token is not None and self.exotel_api_token_file is not None:
            raise ValueError("set DUPLEX_EXOTEL_API_TOKEN or DUPLEX_EXOTEL_API_TOKEN_FILE, not both")
        token_set = self.exotel_api_token is not None or self.exotel_api_token_file is not None
        if token_set != (self.exotel_api_key is not None):
            raise ValueError(
                "the Exotel bridge needs both DUPLEX_EXOTEL_API_KEY and DUPLEX_EXOTEL_API_TOKEN (or _FILE): "
                "Exotel's Basic auth on the upgrade"
            )
        return self

    @model_validator(mode="after")
    def _telnyx_one_secret(self) -> RuntimeConfig:
        if self.telnyx_stream_token is not None and self.telnyx_stream_token_file is not None:
            raise ValueError("set DUPLEX_TELNYX_STREAM_TOKEN or DUPLEX_TELNYX_STREAM_TOKEN_FILE, not both")
        if self.telnyx_stream_token is not None and len(self.telnyx_stream_token.get_secret_value()) < 16:
            raise ValueError(
                "DUPLEX_TELNYX_STREAM_TOKEN must be at least 16 characters (it is the route's only gate)"
            )
        return self

    @model_validator(mode="after")
    def _plivo_needs_its_url(self) -> RuntimeConfig:
        _carrier_settings_paired(
            "Plivo", "PLIVO", self.plivo_auth_token, self.plivo_auth_token_file, self.plivo_stream_url
        )
        return self

    # Scale-in takes the idlest pod (runtime/fleet/deletion_cost.py, issue 33): on Kubernetes only.
    pod_deletion_cost: bool = Field(
        False,
        description="Keep this pod's controller.kubernetes.io/pod-deletion-cost annotation at its live "
        "sessions (a patch through the API server), so a scale-in removes the idlest pod; needs "
        "DUPLEX_POD_NAME and DUPLEX_POD_NAMESPACE (the downward API) and RBAC patch on pods",
    )
    pod_name: str | None = Field(None, min_length=1, description="This pod's name (the downward API)")
    pod_namespace: str | None = Field(
        None, min_length=1, description="This pod's namespace (the downward API)"
    )
    pod_credentials_dir: str = Field(
        "/var/run/secrets/kubernetes.io/serviceaccount",
        min_length=1,
        description="Folder of the pod's service-account token and the cluster's CA (token, ca.crt), for the "
        "deletion-cost patch: the kubelet's projected volume; tests point it at a folder of their own",
    )
    deletion_cost_interval_s: float = Field(
        10.0,
        ge=1,
        le=3600,
        description="Least time between two writes of the pod-deletion-cost annotation (s); also the retry "
        "delay after the API server refused or failed one",
    )

    @model_validator(mode="after")
    def _deletion_cost_needs_its_pod(self) -> RuntimeConfig:
        if self.pod_deletion_cost and (self.pod_name is None or self.pod_namespace is None):
            raise ValueError(
                "DUPLEX_POD_DELETION_COST=true needs DUPLEX_POD_NAME and DUPLEX_POD_NAMESPACE (the pod to "
                "annotate: fieldRef metadata.name and metadata.namespace)"
            )
        return self

    # GCE host maintenance (runtime/frontend/maintenance.py): on a GCE VM's maintenance notice, stop
    # admitting.
    maintenance_watch: Literal["gce", "off"] = Field(
        "off",
        description="gce: watch the GCE metadata server's instance/maintenance-event and stop admitting "
        "new sessions while host maintenance is pending (GCE GPU VMs); off: no watch (on-premises, GKE, "
        "local)",
    )
    maintenance_metadata_url: str = Field(
        "http://metadata.google.internal/computeMetadata/v1/instance/maintenance-event",
        pattern=r"^https?://",
        description="The maintenance-event key's URL (tests point it at a fake metadata server)",
    )

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        return check_preset_name(value)

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind = value.split(":", 1)[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
        return value

    @model_validator(mode="after")
    def _opus_complexity_needs_pyav(self) -> RuntimeConfig:
        if self.opus_encoder == "sphn" and self.opus_complexity != 10:
            raise ValueError(
                f"DUPLEX_OPUS_COMPLEXITY={self.opus_complexity} needs DUPLEX_OPUS_ENCODER=pyav: sphn cannot "
                "set libopus complexity (it encodes at 10)"
            )
        if self.opus_encoder == "pyav":
            try:
                import av  # noqa: F401
            except ImportError:
                raise ValueError(
                    "DUPLEX_OPUS_ENCODER=pyav needs PyAV (pip install av; the runtime extra carries it)"
                ) from None
        return self

    @model_validator(mode="after")
    def _rollover_fractions(self) -> RuntimeConfig:
        if self.rollover_seek_fraction > self.rollover_force_fraction:
            raise ValueError(
                f"DUPLEX_ROLLOVER_SEEK_FRACTION={self.rollover_seek_fraction} must be <= "
                f"DUPLEX_ROLLOVER_FORCE_FRACTION={self.rollover_force_fraction} (a pause is sought "
                "first, then the rollover is forced)"
            )
        return self

    @model_validator(mode="after")
    def _int8_computes_in_fp16(self) -> RuntimeConfig:
        if self.quantize == "int8" and self.dtype not in (None, "float16"):
            raise ValueError(
                f"DUPLEX_QUANTIZE=int8 computes in float16 (moshi's QLinear casts its input to fp16), so "
                f"DUPLEX_DTYPE={self.dtype} cannot apply: leave DUPLEX_DTYPE unset or set it to float16"
            )
        return self

    @field_validator("token_keys", "app_token_keys")
    @classmethod
    def _keys_json(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if value is not None:
            from runtime.signing_keys import keys_from_mapping

            try:
                mapping = json.loads(value.get_secret_value())
            except json.JSONDecodeError:
                raise ValueError('must be JSON: {"<kid>": "<secret of >= 32 bytes>", ...}') from None
            keys_from_mapping(mapping, source=f"DUPLEX_{(info.field_name or '').upper()}")
        return value

    @field_validator("token_revoked_jtis", "token_revoked_kids", mode="before")
    @classmethod
    def _id_list(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    raise ValueError('a JSON list of ids, e.g. ["abc", "def"]') from None
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("plivo_stream_url")
    @classmethod
    def _plivo_stream_url(cls, value: str | None) -> str | None:
        if value is not None and not (value.startswith("wss://") and "?" not in value):
            raise ValueError(
                f"must be the wss:// URL of the Plivo <Stream> without a query string (the call's query is "
                f"signed as it comes), got {value!r}"
            )
        return value

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from runtime.region_routes import check_public_url

        return check_public_url(value)

    @field_validator("pod_ip")
    @classmethod
    def _pod_ip(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from runtime.region_routes import pod_label

        pod_label(value)  # ValueError naming what is allowed
        return value

    @field_validator("twilio_stream_url")
    @classmethod
    def _twilio_stream_url(cls, value: str | None) -> str | None:
        if value is not None and not (value.startswith("wss://") and "?" not in value):
            raise ValueError(
                f"must be the wss:// URL of the TwiML <Stream> without a query string (Twilio connects over "
                f"wss only and drops query strings), got {value!r}"
            )
        return value

    @field_validator("turn_secret")
    @classmethod
    def _turn_secret_length(cls, value: SecretStr | None) -> SecretStr | None:
        from runtime.turn_urls import MIN_SECRET_BYTES

        if value is not None and len(value.get_secret_value().encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"must be at least {MIN_SECRET_BYTES} bytes (coturn's static-auth-secret)")
        return value

    @field_validator("turn_urls", "exotel_personas", mode="before")
    @classmethod
    def _turn_url_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("turn_urls")
    @classmethod
    def _turn_urls(cls, value: list[str]) -> list[str]:
        from runtime.turn_urls import check_turn_url

        return [check_turn_url(url) for url in value]

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _origin_list(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    raise ValueError('a JSON list of origins, e.g. ["https://app.example.com"]') from None
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        return [normalize_origin(origin) for origin in value]

    def signing_keys(self) -> list[SigningKey]:
        """The session-token signing keys from ``DUPLEX_TOKEN_KEYS`` or ``DUPLEX_TOKEN_KEYS_FILE`` (read
        now).

        Raises:
            ValueError: neither or both set, the file unreadable or a key invalid (names the variable).
        """
        keys = _read_keys(self.token_keys, self.token_keys_file, "DUPLEX_TOKEN_KEYS")
        if keys is not None:
            return keys
        raise ValueError(
            "DUPLEX_AUTH_MODE=token needs signing keys: set DUPLEX_TOKEN_KEYS "
            '(JSON {"<kid>": "<secret>"}) or DUPLEX_TOKEN_KEYS_FILE (`duplex token keygen` makes a key), '
            "or DUPLEX_AUTH_MODE=off to serve without access control"
        )

    @property
    def has_app_keys(self) -> bool:
        """``DUPLEX_APP_TOKEN_KEYS`` or ``DUPLEX_APP_TOKEN_KEYS_FILE`` is set."""
        return self.app_token_keys is not None or self.app_token_keys_file is not None

    def app_signing_keys(self) -> list[SigningKey]:
        """The application-token (sessions API) keys from ``DUPLEX_APP_TOKEN_KEYS`` or
        ``DUPLEX_APP_TOKEN_KEYS_FILE`` (read now).

        Raises:
            ValueError: neither or both set, the file unreadable or a key invalid (names the variable).
        """
        keys = _read_keys(self.app_token_keys, self.app_token_keys_file, "DUPLEX_APP_TOKEN_KEYS")
        if keys is not None:
            return keys
        raise ValueError(
            'no application-token keys: set DUPLEX_APP_TOKEN_KEYS (JSON {"<kid>": "<secret>"}) or '
            "DUPLEX_APP_TOKEN_KEYS_FILE (`duplex token keygen` makes a key)"
        )

    def twilio_secret(self) -> str | None:
        """The Twilio auth token (``DUPLEX_TWILIO_AUTH_TOKEN`` or the file's first line, read now); None:
        the Twilio bridge is off.

        Raises:
            ValueError: the file unreadable or empty (names the variable).
        """
        return _carrier_secret("TWILIO", self.twilio_auth_token, self.twilio_auth_token_file)

    def plivo_secret(self) -> str | None:
        """The Plivo auth token (``DUPLEX_PLIVO_AUTH_TOKEN`` or the file's first line, read now); None: the
        Plivo bridge is off.

        Raises:
            ValueError: the file unreadable or empty (names the variable).
        """
        return _carrier_secret("PLIVO", self.plivo_auth_token, self.plivo_auth_token_file)

    def exotel_secret(self) -> str | None:
        """``<key>:<token>``: Exotel's Basic auth credentials (``DUPLEX_EXOTEL_API_KEY`` and
        ``DUPLEX_EXOTEL_API_TOKEN`` or the file's first line, read now); None: the Exotel bridge is off.

        Raises:
            ValueError: the file unreadable or empty (names the variable).
        """
        token = _carrier_secret(
            "EXOTEL", self.exotel_api_token, self.exotel_api_token_file, setting="API_TOKEN"
        )
        return None if token is None or self.exotel_api_key is None else f"{self.exotel_api_key}:{token}"

    def telnyx_secret(self) -> str | None:
        """The Telnyx stream secret (``DUPLEX_TELNYX_STREAM_TOKEN`` or the file's first line, read now);
        None: the Telnyx bridge is off.

        Raises:
            ValueError: the file unreadable or empty (names the variable).
        """
        return _carrier_secret(
            "TELNYX", self.telnyx_stream_token, self.telnyx_stream_token_file, setting="STREAM_TOKEN"
        )

    def load_model_bundle(self) -> ModelBundle:
        """The model these settings name (``model``, ``weights``, ``device``, ``dtype``, ``seed``,
        ``quantize``), with torch's intra-op threads set first (``torch_threads``): what the single
        process and the engine process both load. Imports torch.

        Raises:
            ValueError: a model the device cannot run (``runtime.engine.models.load_model``)."""
        import torch

        from runtime.engine.models import load_model

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        return load_model(
            self.model,
            weights=self.weights,
            device=self.device,
            dtype=getattr(torch, self.dtype) if self.dtype else None,
            seed=self.seed,
            quantize=self.quantize,
        )

    def check_access_control(self) -> None:
        """Cross-field checks of the access settings, made when a server is built (not at parse time, so
        that a config can be built and inspected without keys).

        Raises:
            ValueError: token mode without usable keys, a key id in both the session and application key
                sets, application keys with the deprecated shared-key fallback, or a Redis replay check
                without a Redis URL.
        """
        if self.auth_mode == "off":
            return
        session_kids = {key.kid for key in self.signing_keys()}
        if self.has_app_keys:
            if self.app_tokens_use_session_keys:
                raise ValueError(
                    "DUPLEX_APP_TOKENS_USE_SESSION_KEYS=true is the deprecated fallback for nodes without "
                    "application keys: unset it, since DUPLEX_APP_TOKEN_KEYS is set"
                )
            shared = sorted(session_kids & {key.kid for key in self.app_signing_keys()})
            if shared:
                raise ValueError(
                    f"key id {shared[0]!r} is in both DUPLEX_TOKEN_KEYS and DUPLEX_APP_TOKEN_KEYS: a key "
                    "signs one kind of token; give the application tokens a key of their own"
                )
        if self.token_replay_check in ("redis", "redis-or-memory") and not self.redis_url:
            raise ValueError(
                f"DUPLEX_TOKEN_REPLAY_CHECK={self.token_replay_check} needs DUPLEX_REDIS_URL (used token "
                "ids are kept in Redis); without Redis set DUPLEX_TOKEN_REPLAY_CHECK=memory (this process "
                "only) or off"
            )


def _read_keys(inline: SecretStr | None, file: Path | None, variable: str) -> list[SigningKey] | None:
    """The keys of ``<variable>`` (JSON) or ``<variable>_FILE``; None when neither is set.

    Raises:
        ValueError: both set, the file unreadable or a key invalid (names the variable).
    """
    from runtime.signing_keys import keys_from_mapping, load_key_file

    if inline is not None and file is not None:
        raise ValueError(f"set {variable} or {variable}_FILE, not both")
    if inline is not None:
        return keys_from_mapping(json.loads(inline.get_secret_value()), source=variable)
    if file is not None:
        try:
            return load_key_file(file)
        except ValueError as exc:
            raise ValueError(f"{variable}_FILE: {exc}") from None
    return None


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` in lower case, without a trailing slash; ``*`` stays ``*``.

    Raises:
        ValueError: not an http(s) origin (a path, a query, another scheme).
    """
    text = origin.strip().rstrip("/").lower()
    if text == "*":
        return text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise ValueError(
            f"origin {origin!r} must be scheme://host[:port] with scheme http or https "
            '(e.g. https://app.example.com), or "*"'
        )
    return text


def _carrier_settings_paired(
    carrier: str, env: str, token: SecretStr | None, token_file: Path | None, stream_url: str | None
) -> None:
    """A carrier's auth token (or its file, not both) and its stream URL: both or neither.

    Raises:
        ValueError: naming the variables (``DUPLEX_<env>_AUTH_TOKEN``, ``..._FILE``, ``..._STREAM_URL``).
    """
    if token is not None and token_file is not None:
        raise ValueError(f"set DUPLEX_{env}_AUTH_TOKEN or DUPLEX_{env}_AUTH_TOKEN_FILE, not both")
    if (token is not None or token_file is not None) != (stream_url is not None):
        raise ValueError(
            f"the {carrier} bridge needs both DUPLEX_{env}_AUTH_TOKEN (or _FILE) and "
            f"DUPLEX_{env}_STREAM_URL (the signature covers the stream URL)"
        )


def _carrier_secret(
    env: str, token: SecretStr | None, token_file: Path | None, setting: str = "AUTH_TOKEN"
) -> str | None:
    """A carrier's secret: ``token``, or ``token_file``'s content read now (stripped); None when neither.

    Raises:
        ValueError: the file unreadable or empty, naming ``DUPLEX_<env>_<setting>_FILE``.
    """
    if token is not None:
        return token.get_secret_value()
    if token_file is None:
        return None
    try:
        secret = token_file.read_text().strip()
    except OSError as exc:
        raise ValueError(f"DUPLEX_{env}_{setting}_FILE: {exc}") from None
    if not secret:
        raise ValueError(f"DUPLEX_{env}_{setting}_FILE: {token_file} is empty")
    return secret
