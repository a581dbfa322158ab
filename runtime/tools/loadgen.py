"""A load generator and reference client: real speech streamed at real-time pace over the wire protocol.

Used by the demo (``duplex demo``), by ``duplex loadgen`` against any node, and by the end-to-end tests.
Speech is synthesised with espeak-ng (Debian package ``espeak-ng``) and resampled to 24 kHz.

First-audio budget: each session measures its first audio from its first frame sent (the client's total:
the network both ways included). Given the node's ``/metrics`` (``metrics_url``: the runtime's private
address; nginx answers 404 there), the run reads the node's first-audio histograms before and after and
reports the server's terms for the sessions of the run (docs/benchmarks.md, "First-audio latency budget"):
ingress, phase wait, ticks, tick compute, egress and the server's total, and the mean the server does not
see (client total minus server total: the network, nginx and the client's socket).
"""

from __future__ import annotations

import asyncio
import math
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlencode, urlsplit

import numpy as np
from rich.table import Table
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.frontend.codecs.kyutai_audio import make_codec
from runtime.frontend.codecs.protocol import AudioFormat, MessageKind, encode_audio
from runtime.frontend.gate.tokens import SUBPROTOCOL_PREFIX

TokenVia = Literal["subprotocol", "query"]
"""How a client presents its session token: the ``Sec-WebSocket-Protocol`` ``duplex.token.<jwt>`` (the
default: headers stay out of access logs) or the ``token`` query parameter."""

DEMO_SENTENCES = (
    "Hello, can you hear me? I would like to book a table for two tonight.",
    "What is the weather going to be like tomorrow morning in Paris?",
    "Please tell me a short story about a robot who learns to sing.",
    "I am calling about my order. It was supposed to arrive yesterday.",
    "How many planets are there in the solar system, and which is the largest?",
)


STARTUP_FRAMES = 4
"""Output frames a served session may lack against the input frames it planned to send, before the shortfall
counts as lost: the model's acoustic delay (one frame for the 7B's delays; the engine no longer drops a
session's first frame: its encoder is pre-rolled, docs/runtime.md) and an Ogg page an Opus writer holds
back. The tail a session listens after its last frame (0.6 s, about 7 frames) more than makes up for them:
measured here (sim and tiny models, PCM and Opus), a 40-frame session gets 43 to 47 audio messages back, a
10-frame one 10 to 16."""

CLOSE_NORMAL = 1000
"""The only close code a session may end with (RFC 6455 section 7.4.1); anything else is a failure."""


class SpeechSynthesisError(RuntimeError):
    """espeak-ng is missing or failed."""


def synthesize_speech(text: str, *, voice: str = "en-us", words_per_minute: int = 160) -> np.ndarray:
    """Speak ``text`` with espeak-ng; returns mono float32 PCM at 24 kHz, ``[T]``.

    Raises:
        SpeechSynthesisError: espeak-ng is not installed (``apt-get install espeak-ng``) or failed.
    """
    import sphn

    if shutil.which("espeak-ng") is None:
        raise SpeechSynthesisError("espeak-ng is not installed: apt-get install espeak-ng")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        result = subprocess.run(
            ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(wav), text],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0 or not wav.exists():
            raise SpeechSynthesisError(f"espeak-ng failed ({result.returncode}): {result.stderr.strip()}")
        pcm, rate = sphn.read(str(wav))
    mono = np.asarray(pcm, dtype=np.float32).mean(axis=0)
    if rate != SAMPLE_RATE_HZ:
        mono = sphn.resample(mono, src_sample_rate=rate, dst_sample_rate=SAMPLE_RATE_HZ)
    return np.ascontiguousarray(mono, dtype=np.float32)


def load_wav(path: Path) -> np.ndarray:
    """Read a WAV file (any rate, any channel count) as mono float32 PCM at 24 kHz, ``[T]``.

    Raises:
        ValueError: the file is missing, unreadable, or shorter than one 80 ms frame.
    """
    import sphn

    if not path.is_file():
        raise ValueError(f"speech file {path} does not exist")
    try:
        pcm, rate = sphn.read(str(path))
    except Exception as exc:  # sphn raises plain exceptions for bad containers
        raise ValueError(f"cannot read {path} as audio: {exc}") from None
    mono = np.asarray(pcm, dtype=np.float32).mean(axis=0)
    if rate != SAMPLE_RATE_HZ:
        mono = sphn.resample(mono, src_sample_rate=rate, dst_sample_rate=SAMPLE_RATE_HZ)
    if len(mono) < FRAME_SAMPLES:
        raise ValueError(f"{path} is shorter than one {FRAME_SAMPLES}-sample frame at {SAMPLE_RATE_HZ} Hz")
    return np.ascontiguousarray(mono, dtype=np.float32)


def load_speech(wav_files: Sequence[Path] | None, sessions: int) -> list[np.ndarray]:
    """The speech a load run streams (``run_load`` cycles through it): the given WAV files, or else one
    espeak-ng rendering per demo sentence, as many as the sessions need (at most ``len(DEMO_SENTENCES)``).

    Raises:
        ValueError: a WAV file is missing or unreadable (``load_wav``).
        SpeechSynthesisError: no WAV files given and espeak-ng is missing or failed.
    """
    if wav_files:
        return [load_wav(path) for path in wav_files]
    return [
        synthesize_speech(sentence)
        for sentence in DEMO_SENTENCES[: max(1, min(sessions, len(DEMO_SENTENCES)))]
    ]


@dataclass
class SessionResult:
    """What one client session saw.

    Attributes:
        handshake: the server sent 0x00.
        frames_sent: 80 ms frames streamed.
        audio_messages: 0x01 messages received; ``audio_samples`` the PCM samples they decoded to
            (PCM format only; Opus counts pages).
        text: concatenated 0x02 pieces.
        errors: 0x05 reasons received.
        first_audio_ms: from the first frame sent to the first audio message received.
        close_code: the WebSocket close code (None if the client closed first and got none).
        audio_arrival_s: ``time.monotonic()`` of each audio message.
        connect_ms: from opening the TCP connection to the completed WebSocket upgrade (TLS included).
        http_status, http_body: the HTTP answer when the upgrade was refused (nginx's 503 at the cap, 502
            when the runtime is down, the runtime's own 4xx/503); None when it was accepted.
        connect_error: why the connection could not be made at all (refused port, TLS failure...).
        bytes_sent, bytes_received: WebSocket payload bytes each way.
        frames_planned: 80 ms frames the session meant to send (its whole clip).
    """

    handshake: bool = False
    frames_sent: int = 0
    audio_messages: int = 0
    audio_samples: int = 0
    text: str = ""
    errors: list[str] = field(default_factory=list)
    first_audio_ms: float | None = None
    close_code: int | None = None
    close_reason: str = ""
    audio_arrival_s: list[float] = field(default_factory=list)
    connect_ms: float | None = None
    http_status: int | None = None
    http_body: str = ""
    connect_error: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    frames_planned: int = 0

    @property
    def refused(self) -> bool:
        """The node turned the session away (HTTP refusal, or closed before its handshake)."""
        return self.http_status is not None or (not self.handshake and not self.connect_error)

    @property
    def refusal_reason(self) -> str:
        """The node's words for a refusal ('' when the session was served)."""
        if self.http_status is not None:
            return f"HTTP {self.http_status}: {self.http_body.strip()}"
        if not self.handshake:
            return "; ".join(self.errors) or self.close_reason or self.connect_error
        return ""

    @property
    def ended_early(self) -> bool:
        """A served session that did not end as planned: cut before all its frames were sent (the node
        closed it), or closed with any code other than 1000."""
        return self.handshake and (self.frames_sent < self.frames_planned or self.close_code != CLOSE_NORMAL)

    @property
    def failure(self) -> str:
        """Why this session counts as failed ('' when it was served and ended as planned)."""
        if not self.handshake:
            return f"not served: {self.refusal_reason or 'no handshake'}"
        if not self.ended_early:
            return ""
        close = f"close {self.close_code}" + (f" {self.close_reason!r}" if self.close_reason else "")
        if self.frames_sent < self.frames_planned:
            return f"cut after {self.frames_sent} of {self.frames_planned} frames ({close})"
        return f"ended with {close}"

    def audio_gaps_s(self) -> list[float]:
        """Times between consecutive audio messages (s)."""
        arrivals = self.audio_arrival_s
        return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]

    def max_audio_gap_s(self) -> float:
        """Longest silence between two consecutive audio messages (s); 0 with fewer than 2."""
        return max(self.audio_gaps_s(), default=0.0)

    def frames_lost(self) -> int:
        """Output frames that never came. Inside the stream, a gap of ``g`` s between two messages stands
        for ``round(g / 80 ms) - 1`` missing frames (a gap under 1.5 frames counts none). Before its first
        and after its last message: the session planned ``frames_planned`` frames, and whatever the
        stream (messages plus the gaps' frames) falls short of that by more than ``STARTUP_FRAMES`` is
        lost too, so a session cut by the node, or whose audio stopped early, counts the frames it never
        got. Never more than ``frames_planned`` (when known): frames that arrive late in a burst after a
        gap leave the gap counted and add messages, which must not count past the whole session."""
        frame_s = FRAME_SAMPLES / SAMPLE_RATE_HZ
        in_gaps = sum(max(0, round(g / frame_s) - 1) for g in self.audio_gaps_s())
        never_came = self.frames_planned - STARTUP_FRAMES - (self.audio_messages + in_gaps)
        lost = in_gaps + max(0, never_came)
        return min(lost, self.frames_planned) if self.frames_planned else lost


def session_url(base: str, *, audio_format: AudioFormat = AudioFormat.PCM, **params: object) -> str:
    """``ws://host:port`` + ``/api/chat?format=...&<params>`` (None values left out)."""
    query = {"format": audio_format.value, **{k: v for k, v in params.items() if v is not None}}
    return f"{base.rstrip('/')}/api/chat?{urlencode(query)}"


def with_token(url: str, token: str) -> str:
    """``url`` with ``token=<token>`` added to its query."""
    return f"{url}{'&' if urlsplit(url).query else '?'}{urlencode({'token': token})}"


async def run_session(
    url: str,
    pcm: np.ndarray,
    *,
    realtime: bool = True,
    tail_s: float = 0.6,
    handshake_timeout_s: float = 30.0,
    audio_format: AudioFormat = AudioFormat.PCM,
    raw_messages: list[bytes] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    on_frame: Callable[[], None] | None = None,
    token: str | None = None,
    token_via: TokenVia = "subprotocol",
    messages: Iterable[bytes] | None = None,
) -> SessionResult:
    """Stream ``pcm`` (float32, 24 kHz, ``[T]``) to ``url`` frame by frame and collect what comes back.

    Received audio is counted, never decoded; with ``messages`` (:func:`encode_messages`, made once and
    shared by every session that streams the same clip) nothing is encoded either, so a load run measures
    the server, not its own codec.

    A refused upgrade (HTTP status instead of 101) or an unreachable node is recorded in the result
    (``http_status``/``http_body``, ``connect_error``), not raised.

    Args:
        realtime: pace frames at 80 ms (else send as fast as possible).
        tail_s: keep listening this long after the last frame before closing.
        raw_messages: extra raw messages to send right after the handshake (for bad-input tests).
        ssl_context: for ``wss://`` URLs (e.g. trusting a node's self-signed certificate).
        on_frame: called after each frame sent (progress bars).
        token: the session token (``runtime.frontend.gate.tokens.mint_token``; single-use), or None to send
        none.
        token_via: how to present it (``TokenVia``).
        messages: the 0x01 audio messages to send, one per 80 ms frame, already encoded in
            ``audio_format`` (``pcm`` is then ignored).
    """
    result = SessionResult()
    if messages is None:
        lazy = _LazyMessages(pcm, audio_format)
        to_send: Iterable[bytes] = lazy
        result.frames_planned = len(lazy)
    else:
        to_send = messages = list(messages)
        result.frames_planned = len(messages)
    started: float | None = None
    done = asyncio.Event()
    secure = urlsplit(url).scheme == "wss"
    subprotocols = None
    if token is not None and token_via == "subprotocol":
        subprotocols = [SUBPROTOCOL_PREFIX + token]
    elif token is not None:
        url = with_token(url, token)
    connect_started = time.monotonic()
    try:
        ws = await connect(
            url,
            max_size=2**20,
            compression=None,
            open_timeout=30,
            ssl=(ssl_context or True) if secure else None,
            subprotocols=subprotocols,  # type: ignore[arg-type]
        )
    except InvalidStatus as exc:
        result.http_status = exc.response.status_code
        result.http_body = exc.response.body.decode("utf-8", errors="replace") if exc.response.body else ""
        return result
    except (OSError, InvalidHandshake, TimeoutError) as exc:
        result.connect_error = f"{type(exc).__name__}: {exc}"
        return result
    result.connect_ms = (time.monotonic() - connect_started) * 1e3

    async with ws:

        async def receive() -> None:
            nonlocal started
            try:
                async for message in ws:
                    if isinstance(message, str) or not message:
                        continue
                    result.bytes_received += len(message)
                    kind, payload = message[0], message[1:]
                    now = time.monotonic()
                    if kind == MessageKind.HANDSHAKE:
                        result.handshake = True
                        done.set()
                    elif kind == MessageKind.AUDIO:
                        result.audio_messages += 1
                        result.audio_arrival_s.append(now)
                        if audio_format is AudioFormat.PCM:
                            result.audio_samples += len(payload) // 2
                        if result.first_audio_ms is None and started is not None:
                            result.first_audio_ms = (now - started) * 1e3
                    elif kind == MessageKind.TEXT:
                        result.text += payload.decode("utf-8", errors="replace")
                    elif kind == MessageKind.ERROR:
                        result.errors.append(payload.decode("utf-8", errors="replace"))
            except ConnectionClosed:
                pass
            finally:
                done.set()

        receiver = asyncio.create_task(receive())
        try:
            await asyncio.wait_for(done.wait(), handshake_timeout_s)
            if result.handshake:
                for raw in raw_messages or []:
                    await ws.send(raw)
                    result.bytes_sent += len(raw)
                next_send = time.monotonic()
                for message in to_send:
                    if started is None:
                        started = time.monotonic()
                    await ws.send(message)
                    result.frames_sent += 1
                    result.bytes_sent += len(message)
                    if on_frame is not None:
                        on_frame()
                    if realtime:
                        next_send += FRAME_SAMPLES / SAMPLE_RATE_HZ
                        await asyncio.sleep(max(0.0, next_send - time.monotonic()))
                await asyncio.sleep(tail_s)
                await ws.close()
            await asyncio.wait_for(receiver, 10)
        except ConnectionClosed:
            pass
        finally:
            receiver.cancel()
        result.close_code = ws.close_code
        result.close_reason = ws.close_reason or ""
    return result


def encode_messages(pcm: np.ndarray, audio_format: AudioFormat = AudioFormat.OPUS) -> list[bytes]:
    """``pcm`` (float32, 24 kHz, ``[T]``) as the 0x01 audio messages a session sends, one per whole 80 ms
    frame, in ``audio_format`` (Ogg/Opus: the first message carries the OpusHead/OpusTags pages, so the list
    replays as a whole stream from its start). A frame whose Opus page is not ready yet is sent as an empty
    audio message, as a live client would send whatever its encoder gave."""
    _, encoder = make_codec(audio_format, max_buffered_frames=1000)
    frames = range(0, len(pcm) - FRAME_SAMPLES + 1, FRAME_SAMPLES)
    return [encode_audio(encoder.encode(pcm[i : i + FRAME_SAMPLES])) for i in frames]


class _LazyMessages:
    """The messages of :func:`encode_messages`, each encoded when sent (a live client's cost)."""

    def __init__(self, pcm: np.ndarray, audio_format: AudioFormat) -> None:
        self.pcm = pcm
        self.audio_format = audio_format

    def __len__(self) -> int:
        """Whole 80 ms frames in the clip (a partial last frame is not sent)."""
        return max(0, len(self.pcm) // FRAME_SAMPLES)

    def __iter__(self) -> Iterator[bytes]:
        _, encoder = make_codec(self.audio_format, max_buffered_frames=1000)
        for i in range(0, len(self.pcm) - FRAME_SAMPLES + 1, FRAME_SAMPLES):
            yield encode_audio(encoder.encode(self.pcm[i : i + FRAME_SAMPLES]))


def _percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear interpolation) or None without values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


FIRST_AUDIO_TERMS: tuple[tuple[str, str], ...] = (
    ("total", "duplex_first_audio_latency_seconds"),
    ("ingress", "duplex_first_audio_ingress_seconds"),
    ("phase_wait", "duplex_first_audio_phase_wait_seconds"),
    ("ticks", "duplex_first_audio_ticks"),
    ("tick_compute", "duplex_first_audio_tick_compute_seconds"),
    ("egress", "duplex_first_audio_egress_seconds"),
)
"""The first-audio budget's terms as the node's histograms name them (``runtime.metrics``): seconds, but for
``ticks``, a count of 80 ms ticks."""


@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram as scraped: ``buckets`` ``(le, cumulative count)`` sorted by ``le``
    (``+Inf`` last), ``count``, ``sum``."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def minus(self, before: Histogram | None) -> Histogram:
        """What was observed since ``before`` (the same histogram scraped earlier; None: since the start)."""
        if before is None:
            return self
        old = dict(before.buckets)
        return Histogram(
            tuple((le, n - old.get(le, 0.0)) for le, n in self.buckets),
            self.count - before.count,
            self.sum - before.sum,
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus's ``histogram_quantile``: linear within the bucket holding rank ``q * count`` (from 0
        for the first bucket), the highest finite bound when it falls in ``+Inf``; None when empty."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower
                if cumulative == below:
                    return le
                return lower + (le - lower) * (rank - below) / (cumulative - below)
            lower, below = le, cumulative
        return lower

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


def parse_histograms(text: str, names: Iterable[str]) -> dict[str, Histogram]:
    """The histograms called ``names`` in a Prometheus text exposition (summed over label sets); a name the
    text lacks is left out."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = set(names)
    found: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        buckets: dict[float, float] = {}
        count = total = 0.0
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
        found[family.name] = Histogram(tuple(sorted(buckets.items())), count, total)
    return found


def fetch_metrics(url: str, *, timeout_s: float = 5.0) -> str:
    """``GET url`` (a node's ``/metrics``), no proxy. Raises OSError when it does not answer 200."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout_s) as response:
        return response.read().decode("utf-8", errors="replace")


def first_audio_budget(
    before: Mapping[str, Histogram], after: Mapping[str, Histogram], client_first_audio_ms: Sequence[float]
) -> dict[str, float | None]:
    """The first-audio budget of one run from the node's histograms scraped ``before`` and ``after`` it:
    per term (``FIRST_AUDIO_TERMS``) ``<term>_ms_p50``, ``_p99`` and ``_mean`` (``ticks_p50``, ``_p99``,
    ``_mean`` for the tick count), ``sessions`` (first audios the node observed meanwhile), and
    ``outside_runtime_ms_mean``: the clients' mean first audio minus the node's (the network both ways,
    nginx, the client's own socket), and ``pacing_ms_mean``: what the node's mean total has beyond its
    terms' means with each tick counted as 80 ms (the ticks' actual spacing: a tick that starts late adds
    its lateness to the phase wait and takes it from the spacing to the next). Quantiles are bucket
    estimates, as Prometheus's."""
    budget: dict[str, float | None] = {}
    for term, name in FIRST_AUDIO_TERMS:
        histogram = after.get(name)
        delta = histogram.minus(before.get(name)) if histogram is not None else None
        scale, key = (1.0, term) if term == "ticks" else (1e3, f"{term}_ms")
        for suffix, value in (
            ("p50", delta.quantile(0.5) if delta else None),
            ("p99", delta.quantile(0.99) if delta else None),
            ("mean", delta.mean if delta else None),
        ):
            budget[f"{key}_{suffix}"] = None if value is None else round(value * scale, 3)
        if term == "total":
            budget["sessions"] = delta.count if delta else 0
    server_mean = budget["total_ms_mean"]
    terms = [budget[f"{term}_ms_mean"] for term in ("ingress", "phase_wait", "tick_compute", "egress")]
    ticks = budget["ticks_mean"]
    budget["pacing_ms_mean"] = (
        None
        if server_mean is None or ticks is None or None in terms
        else round(
            server_mean - sum(t or 0.0 for t in terms) - ticks * FRAME_SAMPLES / SAMPLE_RATE_HZ * 1e3, 3
        )
    )
    client_mean = float(np.mean(client_first_audio_ms)) if len(client_first_audio_ms) else None
    budget["client_first_audio_ms_mean"] = None if client_mean is None else round(client_mean, 3)
    budget["outside_runtime_ms_mean"] = (
        None if client_mean is None or server_mean is None else round(client_mean - server_mean, 3)
    )
    return budget


def budget_line(budget: Mapping[str, float | None]) -> str:
    """The budget in two lines: the means, which add up (ticks x 80 ms), then p50/p99 of each term (ms)."""

    def ms(key: str) -> str:
        value = budget.get(key)
        return "-" if value is None else f"{value:.1f}"

    def p50_99(term: str) -> str:
        return f"{term.replace('_', ' ')} {ms(f'{term}_ms_p50')}/{ms(f'{term}_ms_p99')}"

    ticks, ticks_p99 = budget.get("ticks_mean"), budget.get("ticks_p99")
    frame_ms = FRAME_SAMPLES / SAMPLE_RATE_HZ * 1e3
    ticks_text = "-" if ticks is None else f"{ticks:.2f} x {frame_ms:.0f}"
    return (
        f"first audio, means (ms): client {ms('client_first_audio_ms_mean')} = outside the runtime "
        f"{ms('outside_runtime_ms_mean')} + runtime {ms('total_ms_mean')} (ingress {ms('ingress_ms_mean')} "
        f"+ phase wait {ms('phase_wait_ms_mean')} + ticks {ticks_text} + tick compute "
        f"{ms('tick_compute_ms_mean')} + egress {ms('egress_ms_mean')} + tick pacing "
        f"{ms('pacing_ms_mean')}); {budget.get('sessions') or 0:.0f} "
        f"sessions at the node\nfirst audio, p50/p99 (ms): "
        + ", ".join(p50_99(t) for t in ("total", "phase_wait", "tick_compute", "egress", "ingress"))
        + f"; ticks p99 {'-' if ticks_p99 is None else round(ticks_p99)}"
    )


@dataclass
class LoadReport:
    """Totals over the sessions of one load run (``run_load``). Times in ms, sizes in bytes.

    Attributes:
        sessions: every session's own result, in launch order.
        wall_s: from the first connection attempt to the last session's end.
    """

    sessions: list[SessionResult]
    wall_s: float
    cpu_s: float | None = None
    """CPU time (user + system) this load generator's process spent during the run."""
    budget: dict[str, float | None] | None = None
    """The node's first-audio budget over the run (:func:`first_audio_budget`), when its ``/metrics`` was
    given and answered."""
    budget_error: str = ""
    """Why the budget is missing although ``/metrics`` was given."""

    @property
    def served(self) -> list[SessionResult]:
        """Sessions that got the handshake."""
        return [r for r in self.sessions if r.handshake]

    @property
    def ok(self) -> bool:
        """Every session was served and ended as planned (``duplex loadgen`` exits 0 only then)."""
        return not self.failures()

    def failures(self) -> list[str]:
        """``"session i: why"`` for every session that was not served, could not connect, or ended early
        (:attr:`SessionResult.failure`), in launch order."""
        return [f"session {i}: {r.failure}" for i, r in enumerate(self.sessions) if r.failure]

    def summary(self) -> dict[str, float | int | None]:
        """Totals: served/refused/failed counts, ``cut`` (served sessions that ended early: cut before
        their last frame or closed with a code other than 1000), connect time p50/p99, first-audio latency
        p50/p95/p99, inter-frame gap p99 (jitter: time between consecutive audio messages; 80 ms when
        steady), frames sent/received/lost (:meth:`SessionResult.frames_lost`), bytes each way."""
        served = self.served
        first_audio = [r.first_audio_ms for r in served if r.first_audio_ms is not None]
        connect = [r.connect_ms for r in self.sessions if r.connect_ms is not None]
        gaps_ms = [g * 1e3 for r in served for g in r.audio_gaps_s()]
        return {
            "sessions": len(self.sessions),
            "served": len(served),
            "refused": sum(r.refused for r in self.sessions),
            "failed": sum(bool(r.connect_error) for r in self.sessions),
            "cut": sum(r.ended_early for r in served),
            "connect_ms_p50": _percentile(connect, 50),
            "connect_ms_p99": _percentile(connect, 99),
            "first_audio_ms_p50": _percentile(first_audio, 50),
            "first_audio_ms_p95": _percentile(first_audio, 95),
            "first_audio_ms_p99": _percentile(first_audio, 99),
            "inter_frame_gap_ms_p99": _percentile(gaps_ms, 99),
            "frames_sent": sum(r.frames_sent for r in self.sessions),
            "frames_received": sum(r.audio_messages for r in self.sessions),
            "frames_lost": sum(r.frames_lost() for r in served),
            "bytes_sent": sum(r.bytes_sent for r in self.sessions),
            "bytes_received": sum(r.bytes_received for r in self.sessions),
            "wall_s": round(self.wall_s, 3),
            "loadgen_cpu_s": None if self.cpu_s is None else round(self.cpu_s, 3),
            "loadgen_cpu_percent": (
                None if self.cpu_s is None or not self.wall_s else round(100 * self.cpu_s / self.wall_s, 1)
            ),
        }

    def session_rows(self) -> list[dict[str, object]]:
        """One JSON-ready dict per session (no raw arrival times)."""
        rows: list[dict[str, object]] = []
        for i, r in enumerate(self.sessions):
            gaps_ms = [g * 1e3 for g in r.audio_gaps_s()]
            rows.append(
                {
                    "session": i,
                    "handshake": r.handshake,
                    "connect_ms": r.connect_ms,
                    "first_audio_ms": r.first_audio_ms,
                    "inter_frame_gap_ms_p99": _percentile(gaps_ms, 99),
                    "frames_sent": r.frames_sent,
                    "frames_received": r.audio_messages,
                    "frames_lost": r.frames_lost(),
                    "bytes_sent": r.bytes_sent,
                    "bytes_received": r.bytes_received,
                    "text": r.text,
                    "refused": r.refused,
                    "refusal_reason": r.refusal_reason,
                    "close_code": r.close_code,
                    "failure": r.failure,
                }
            )
        return rows


MAX_LOAD_SESSIONS = 256
"""Most sessions one ``run_load`` drives (a node has at most 256 slots)."""


def check_load_args(sessions: int, speech: Sequence[Any], max_duration_s: float, token: object) -> None:
    """Check a load run's arguments (``run_load``'s, ``run_rtc_load``'s): ``sessions`` in
    1..MAX_LOAD_SESSIONS, at least one speech clip, ``max_duration_s`` a positive finite number of seconds,
    and a single ``str`` token only for a single session. Raises ValueError naming the first that is not."""
    if not 1 <= sessions <= MAX_LOAD_SESSIONS:
        raise ValueError(f"sessions must be between 1 and {MAX_LOAD_SESSIONS}, got {sessions}")
    if not speech:
        raise ValueError("no speech to stream: give at least one WAV file")
    if not (max_duration_s > 0 and math.isfinite(max_duration_s)):
        raise ValueError(f"max_duration_s must be a positive number of seconds, got {max_duration_s}")
    if isinstance(token, str) and sessions > 1:
        raise ValueError("a session token opens one session: pass a token factory for several sessions")


ResultT = TypeVar("ResultT", bound=SessionResult)


async def gather_sessions(
    tasks: Sequence[asyncio.Task[ResultT]], max_duration_s: float, failed: Callable[[], ResultT]
) -> list[ResultT]:
    """Wait up to ``max_duration_s`` (seconds) for the session ``tasks``, cancel those still running, and
    return one result per task, in ``tasks`` order: the task's own result, or else ``failed()`` with its
    ``connect_error`` set to ``"cut at max_duration_s=..."`` (cancelled at the deadline) or to the repr of
    the exception the task raised. Raises nothing of the tasks' own."""
    done, pending = await asyncio.wait(tasks, timeout=max_duration_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    results = []
    for task in tasks:
        if task in done and task.exception() is None:
            results.append(task.result())
        else:
            result = failed()
            result.connect_error = (
                f"cut at max_duration_s={max_duration_s}" if task in pending else repr(task.exception())
            )
            results.append(result)
    return results


async def run_load(
    url: str,
    speech: Sequence[np.ndarray],
    *,
    sessions: int,
    ssl_context: ssl.SSLContext | None = None,
    max_duration_s: float = 120.0,
    stagger_s: float = 0.0,
    on_frame: Callable[[], None] | None = None,
    audio_format: AudioFormat = AudioFormat.PCM,
    token: str | Callable[[], str] | None = None,
    token_via: TokenVia = "subprotocol",
    pre_encode: bool = True,
    metrics_url: str | None = None,
) -> LoadReport:
    """Drive ``sessions`` concurrent sessions against ``url`` (a full ``.../api/chat?...`` URL), session
    ``i`` streaming ``speech[i % len(speech)]`` at real-time pace.

    Args:
        max_duration_s: the whole run is cancelled after this (sessions still open count as they stand).
        stagger_s: delay between session starts (s).
        token: a token factory called once per session, just before it connects (tokens are single-use);
            a plain token for a single session; None for a node without access control.
        token_via: how each session presents its token (``TokenVia``).
        pre_encode: encode each clip once before the run and replay its messages in every session
            (:func:`encode_messages`), so the generator's CPU goes to the sockets; False: every session
            encodes its own audio as a live client does. The report's ``loadgen_cpu_percent`` says what
            the generator itself cost (100 = one core).
        metrics_url: the node's ``/metrics`` (its private address, e.g. ``http://127.0.0.1:8998/metrics``):
            read before and after the run for the server's first-audio terms (``LoadReport.budget``).

    Raises:
        ValueError: ``sessions`` outside 1..MAX_LOAD_SESSIONS, no speech, a non-positive duration, or one
            token for several sessions.
    """
    check_load_args(sessions, speech, max_duration_s, token)
    encoded: list[list[bytes]] | None = None
    if pre_encode:
        encoded = [encode_messages(clip, audio_format) for clip in speech[: min(len(speech), sessions)]]
    names = [name for _, name in FIRST_AUDIO_TERMS]
    before: dict[str, Histogram] | None = None
    budget_error = ""
    if metrics_url:
        try:
            before = parse_histograms(await asyncio.to_thread(fetch_metrics, metrics_url), names)
        except (OSError, ValueError) as exc:
            budget_error = f"{metrics_url}: {exc}"
    started = time.monotonic()
    cpu_started = time.process_time()

    async def one(i: int) -> SessionResult:
        await asyncio.sleep(i * stagger_s)
        return await run_session(
            url,
            speech[i % len(speech)],
            messages=None if encoded is None else encoded[i % len(encoded)],
            ssl_context=ssl_context,
            on_frame=on_frame,
            audio_format=audio_format,
            token=token() if callable(token) else token,
            token_via=token_via,
        )

    tasks = [asyncio.create_task(one(i)) for i in range(sessions)]
    results = await gather_sessions(tasks, max_duration_s, SessionResult)
    report = LoadReport(results, time.monotonic() - started, time.process_time() - cpu_started)
    if metrics_url and before is not None:
        try:
            after = parse_histograms(await asyncio.to_thread(fetch_metrics, metrics_url), names)
        except (OSError, ValueError) as exc:
            budget_error = f"{metrics_url}: {exc}"
        else:
            client = [r.first_audio_ms for r in report.served if r.first_audio_ms is not None]
            report.budget = first_audio_budget(before, after, client)
    report.budget_error = budget_error
    return report


def trusting_context(certificate: Path) -> ssl.SSLContext:
    """An SSL context that trusts ``certificate`` (a node's self-signed PEM) and verifies host names."""
    return ssl.create_default_context(cafile=str(certificate))


def load_table(title: str, report: Any) -> Table:
    """A Rich table of ``report`` (a ``LoadReport``): one row per session (times in ms), then the totals as
    its caption (``duplex loadgen``, ``duplex node up``)."""
    table = Table(title=title)
    # Times in ms; frames "in" were sent to the node, "out" came back. Fits an 80-column terminal.
    for column in ("#", "conn", "1st audio", "gap p99", "in", "out", "lost"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("text / refusal", max_width=24, no_wrap=True, overflow="ellipsis")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for row in report.session_rows():
        table.add_row(
            str(row["session"]),
            ms(row["connect_ms"]),
            ms(row["first_audio_ms"]),
            ms(row["inter_frame_gap_ms_p99"]),
            str(row["frames_sent"]),
            str(row["frames_received"]),
            str(row["frames_lost"]),
            str(row["failure"]) if row["failure"] else (row["text"].strip() or "-"),
        )
    total = report.summary()
    table.caption = (
        f"served {total['served']}/{total['sessions']}, refused {total['refused']}, "
        f"failed {total['failed']}, cut {total['cut']}; "
        f"first audio p50/p95/p99 {ms(total['first_audio_ms_p50'])}/{ms(total['first_audio_ms_p95'])}/"
        f"{ms(total['first_audio_ms_p99'])} ms; gap p99 {ms(total['inter_frame_gap_ms_p99'])} ms; "
        f"frames lost {total['frames_lost']}; {total['bytes_sent'] / 1e6:.2f} MB sent, "
        f"{total['bytes_received'] / 1e6:.2f} MB received (times in ms); "
        f"load generator CPU {total.get('loadgen_cpu_percent')} % of a core"
    )
    budget = getattr(report, "budget", None)
    if budget:
        table.caption += "\n" + budget_line(budget)
    elif getattr(report, "budget_error", ""):
        table.caption += f"\nno first-audio budget: {report.budget_error}"
    return table
