"""Session recordings, with the caller's consent: both sides of a conversation as Ogg Opus files.

A session whose token carries ``recording_consent: true`` (``runtime.frontend.gate.tokens``) on a node with
``DUPLEX_RECORDING_DIR`` gets a :class:`SessionRecorder`. The session calls :meth:`SessionRecorder.caller`
with each audio payload it takes from the client (after the handshake) and :meth:`SessionRecorder.agent`
with each encoded payload it sends: a queue put, never a wait. One thread per recorder writes:

- Opus sessions: the payloads are already Ogg Opus pages (the client's encoder, the session's encoder):
  they are written as they pass, no decode and no encode. The pages are renumbered into one clean stream
  (the client's OpusHead/OpusTags pages go out before the handshake and are not seen: a standard header
  is written in their place, with the stream's serial number), each page's checksum recomputed.
- PCM sessions: the Int16 samples are encoded to Ogg Opus in the thread (PyAV's libopus, which releases
  the GIL), off the audio path.

If the thread falls behind by :data:`QUEUE_PAYLOADS` payloads, further payloads are left out of the
recording (``duplex_recording_errors_total{reason="queue_full"}``); a disk error stops that side
(``reason="write"``). The session's audio is never affected.

Files: ``<dir>/<session id>.<side>.opus`` (side ``caller`` or ``agent``), written as ``.opus.part`` and
renamed when the session ends; only finished files are served (``GET /api/sessions/<id>/recording/<side>``).
They are erased with the session (``DELETE /api/sessions/<id>``) and swept once older than the
transcript retention (``DUPLEX_TRANSCRIPT_TTL_S``).

The directory may be shared by every pod of a region: on the multi-region stack it is the region's bucket,
mounted by Cloud Storage FUSE (docs/sessions-api.md, "Recording"). There a file being written is not seen
by the other mounts until it is closed (gcsfuse makes a new file an object only on close: semantics.md of
GoogleCloudPlatform/gcsfuse, "Writes"), so an erase answered by another pod cannot delete a recording still
being finished: :meth:`LocalRecordings.erase` first leaves a marker ``<id>.erased``, and a recorder that
finishes after it deletes its own files (:meth:`LocalRecordings.commit`). Markers go with the sweep.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import BinaryIO

import numpy as np

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.frontend.codecs.kyutai_audio import (
    _SPHN_OPUS_HEAD,
    _SPHN_OPUS_TAGS,
    FrameEncoder,
    OpusFrameEncoder,
    PyavOpusFrameEncoder,
    ogg_crc,
    split_ogg_pages,
)
from runtime.metrics import RuntimeMetrics

__all__ = [
    "OGG_OPUS_CONTENT_TYPE",
    "QUEUE_PAYLOADS",
    "SESSION_ID_RE",
    "SIDES",
    "LocalRecordings",
    "OggRenumberer",
    "RecordingStore",
    "SessionRecorder",
]

log = logging.getLogger(__name__)

SIDES = ("caller", "agent")
"""The two sides of a recording: what the caller sent, what the model said."""
SESSION_ID_RE = re.compile(r"[0-9a-f]{32}")
"""A session id: a UUID as 32 lowercase hex digits (``uuid.uuid4().hex``); nothing else names a file."""
OGG_OPUS_CONTENT_TYPE = "audio/ogg; codecs=opus"
"""RFC 7845, 9."""
QUEUE_PAYLOADS = 500
"""Payloads (both sides) a recorder may hold before its thread writes them: 500 x 40-80 ms, over 20 s."""
PCM_RECORDING_COMPLEXITY = 5
"""libopus complexity for encoding PCM sessions' recordings (0.6 ms per frame here: FIELD notes)."""

_PART = ".part"
_ERASED = ".erased"


class RecordingStore(abc.ABC):
    """Where recordings live: a directory (:class:`LocalRecordings`), the node's disk or a region's bucket
    mounted by Cloud Storage FUSE (docs/sessions-api.md, "Recording"). Another kind of store (an object
    store's own API) would implement these five calls."""

    @abc.abstractmethod
    def create(self, session_id: str, side: str) -> BinaryIO:
        """A new file for a recording in progress (in the writer thread).

        Raises:
            ValueError: a bad session id or side. OSError: it cannot be created.
        """

    @abc.abstractmethod
    def commit(self, session_id: str, side: str, handle: BinaryIO) -> None:
        """Close ``handle`` and make the recording visible (a recording erased meanwhile stays erased)."""

    @abc.abstractmethod
    def local_path(self, session_id: str, side: str) -> Path | None:
        """The finished recording's file, or None when there is none."""

    @abc.abstractmethod
    def erase(self, session_id: str) -> int:
        """Delete every file of the session (finished or in progress); returns how many."""

    @abc.abstractmethod
    def sweep(self, max_age_s: float, now: float | None = None) -> int:
        """Delete the files last written more than ``max_age_s`` (s) ago; returns how many."""


def _check(session_id: str, side: str) -> None:
    if not isinstance(session_id, str) or not SESSION_ID_RE.fullmatch(session_id):
        raise ValueError(f"session id {session_id!r} is not 32 lowercase hex digits")
    if side not in SIDES:
        raise ValueError(f"side {side!r} is not one of {', '.join(SIDES)}")


class LocalRecordings(RecordingStore):
    """Recordings in one directory (created when missing; mode 0700): the node's disk, or a bucket mounted
    by Cloud Storage FUSE that every pod of a region shares (see the module doc for what differs there).

    Raises:
        OSError: the directory cannot be created.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, session_id: str, side: str) -> Path:
        _check(session_id, side)
        return self.directory / f"{session_id}.{side}.opus"

    def _marker(self, session_id: str) -> Path:
        _check(session_id, SIDES[0])
        return self.directory / f"{session_id}{_ERASED}"

    def create(self, session_id: str, side: str) -> BinaryIO:
        """Open the side's ``.part`` file for writing, mode 0600 (a caller's voice: readable by the runtime's
        user only, whatever the umask).

        Raises:
            OSError: the file cannot be created.
        """
        part = self._path(session_id, side).with_name(self._path(session_id, side).name + _PART)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        return os.fdopen(fd, "wb")

    def commit(self, session_id: str, side: str, handle: BinaryIO) -> None:
        """Close ``handle`` and rename the ``.part`` file to its final name; when the session was erased
        meanwhile (its marker exists, left by any pod sharing the directory), delete both instead.

        Raises:
            OSError: closing (on Cloud Storage FUSE: the upload) or renaming failed.
        """
        handle.close()
        final = self._path(session_id, side)
        part = final.with_name(final.name + _PART)
        with contextlib.suppress(FileNotFoundError):  # erased here while it was written: stays erased
            os.replace(part, final)
        if self._marker(session_id).exists():  # erased (maybe by another pod) before it was visible there
            for path in (final, part):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def local_path(self, session_id: str, side: str) -> Path | None:
        path = self._path(session_id, side)
        if not path.is_file() or self._marker(session_id).exists():
            return None
        return path

    def erase(self, session_id: str) -> int:
        """Leave the session's erase marker (a recorder still finishing deletes its files when it
        commits), then delete every file of the session; returns how many files were deleted (the marker
        not counted).

        Raises:
            ValueError: a bad session id. OSError: the marker cannot be written or a file deleted.
        """
        self._marker(session_id).touch()
        removed = 0
        for side in SIDES:
            final = self._path(session_id, side)
            for path in (final, final.with_name(final.name + _PART)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
        return removed

    def sweep(self, max_age_s: float, now: float | None = None) -> int:
        """Delete the recordings (finished or left ``.part``) and erase markers last written more than
        ``max_age_s`` (s) ago; returns how many recordings were deleted (markers not counted). A file that
        cannot be deleted is logged and left for the next sweep; a file another pod deleted first is
        skipped.

        Raises:
            OSError: the directory cannot be listed.
        """
        cutoff = (time.time() if now is None else now) - max_age_s
        removed = 0
        with os.scandir(self.directory) as entries:
            for entry in entries:
                marker = entry.name.endswith(_ERASED)
                if not (marker or entry.name.endswith((".opus", ".opus" + _PART))):
                    continue
                try:
                    if not entry.is_file() or entry.stat().st_mtime >= cutoff:
                        continue
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    log.warning("recording sweep: %s not deleted: %s", entry.name, exc)
                    continue
                removed += 0 if marker else 1
        return removed


def _page_packet_start(page: bytes) -> int:
    return 27 + page[26]


def _ogg_page(header_type: int, granule: bytes, serial: bytes, sequence: int, packet: bytes) -> bytes:
    lacing = bytes([255] * (len(packet) // 255) + [len(packet) % 255])
    page = b"OggS\x00" + bytes([header_type]) + granule + serial + sequence.to_bytes(4, "little")
    page += b"\x00\x00\x00\x00" + bytes([len(lacing)]) + lacing + packet
    return page[:22] + ogg_crc(page).to_bytes(4, "little") + page[26:]


class OggRenumberer:
    """Ogg Opus bytes as they pass (pages possibly cut across payloads) -> one clean Ogg Opus stream: a
    header (OpusHead, OpusTags) first, written when the stream does not start with its own, then every
    audio page with one serial number, consecutive sequence numbers and its checksum recomputed. No packet
    is decoded or encoded.

    Raises (from :meth:`feed`):
        ValueError: the bytes are not Ogg pages.
    """

    def __init__(self) -> None:
        self._rest = b""
        self._serial: bytes | None = None
        self._sequence = 0
        self._header_done = False

    def feed(self, data: bytes) -> bytes:
        """The stream's bytes for the whole pages completed by ``data``."""
        pages, self._rest = split_ogg_pages(self._rest + data)
        out = []
        for page in pages:
            if len(page) < 27 or page[:4] != b"OggS" or len(page) < _page_packet_start(page):
                raise ValueError("not an Ogg page")
            packet = page[_page_packet_start(page) :]
            is_header = packet.startswith((b"OpusHead", b"OpusTags"))
            if self._serial is None:
                self._serial = page[14:18]
                if not packet.startswith(b"OpusHead"):
                    out.append(_ogg_page(2, bytes(8), self._serial, 0, _SPHN_OPUS_HEAD))
                    out.append(_ogg_page(0, bytes(8), self._serial, 1, _SPHN_OPUS_TAGS))
                    self._sequence, self._header_done = 2, True
            elif is_header and self._header_done:
                continue  # a second header (a restarted client encoder): one stream, one header
            elif packet.startswith(b"OpusTags"):
                self._header_done = True
            flags = page[5] & 0x01 if self._sequence else 0x02  # BOS on the first page only; no EOS
            head = (
                page[:5] + bytes([flags]) + page[6:14] + self._serial + self._sequence.to_bytes(4, "little")
            )
            fixed = head + b"\x00\x00\x00\x00" + page[26:]
            out.append(fixed[:22] + ogg_crc(fixed).to_bytes(4, "little") + fixed[26:])
            self._sequence += 1
        return b"".join(out)


class _PcmToOpus:
    """Int16 LE 24 kHz PCM bytes -> Ogg Opus pages, in whole 1920-sample frames (a partial last frame is
    left out)."""

    def __init__(self) -> None:
        self._rest = b""
        try:
            self._encoder: FrameEncoder = PyavOpusFrameEncoder(PCM_RECORDING_COMPLEXITY)
        except ImportError:  # PyAV is a dependency of the runtime; sphn as a last resort
            self._encoder = OpusFrameEncoder()

    def feed(self, data: bytes) -> bytes:
        buffered = self._rest + data
        frame_bytes = 2 * FRAME_SAMPLES
        whole = len(buffered) // frame_bytes * frame_bytes
        self._rest = buffered[whole:]
        out = []
        for start in range(0, whole, frame_bytes):
            samples = np.frombuffer(buffered, dtype="<i2", count=FRAME_SAMPLES, offset=start)
            out.append(self._encoder.encode(samples.astype(np.float32) / np.float32(32768.0)))
        return b"".join(out)


class SessionRecorder:
    """One session's recording (see the module doc): two sides, one writer thread, a bounded queue.

    Args:
        store: where the files go.
        session_id: the session (32 hex digits).
        audio_format: ``"opus"`` (payloads are Ogg Opus) or ``"pcm"`` (Int16 LE, encoded here).
        metrics: ``duplex_recordings_total``, ``duplex_recording_bytes_total``, ``..._errors_total``.
        max_queue: payloads held before further ones are left out.

    Raises:
        ValueError: a bad session id or format.
    """

    def __init__(
        self,
        store: RecordingStore,
        session_id: str,
        audio_format: str,
        metrics: RuntimeMetrics,
        *,
        max_queue: int = QUEUE_PAYLOADS,
    ) -> None:
        _check(session_id, SIDES[0])
        if audio_format not in ("opus", "pcm"):
            raise ValueError(f"audio format {audio_format!r} is not opus or pcm")
        self.store = store
        self.session_id = session_id
        self.audio_format = audio_format
        self.metrics = metrics
        self.bytes_written = dict.fromkeys(SIDES, 0)
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue(max_queue)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"recorder {session_id[:8]}", daemon=True)
        self._thread.start()

    def caller(self, payload: bytes) -> None:
        """One payload the client sent (never blocks, never raises)."""
        self._put("caller", payload)

    def agent(self, payload: bytes) -> None:
        """One payload sent to the client (never blocks, never raises)."""
        self._put("agent", payload)

    def _put(self, side: str, payload: bytes) -> None:
        if self._closing or not payload:
            return
        try:
            self._queue.put_nowait((side, bytes(payload)))
        except queue.Full:
            self.metrics.recording_errors.labels(reason="queue_full").inc()

    def close(self) -> None:
        """The session is over: the thread writes what is queued, then finishes the files (never blocks)."""
        self._closing = True
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (s) for the files to be finished (tests, shutdown); True when done."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        handles: dict[str, BinaryIO] = {}
        coders: dict[str, OggRenumberer | _PcmToOpus] = {}
        failed: set[str] = set()
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if self._closing:
                    break
                continue
            if item is None:
                break
            side, payload = item
            if side in failed:
                continue
            try:
                if side not in handles:
                    coders[side] = OggRenumberer() if self.audio_format == "opus" else _PcmToOpus()
                    handles[side] = self.store.create(self.session_id, side)
                data = coders[side].feed(payload)
                if data:
                    handles[side].write(data)
                    self.bytes_written[side] += len(data)
                    self.metrics.recording_bytes.labels(side=side).inc(len(data))
            except (OSError, ValueError) as exc:
                log.warning("recording %s (%s) stopped: %s", self.session_id, side, exc)
                self.metrics.recording_errors.labels(reason="write").inc()
                failed.add(side)
                handle = handles.pop(side, None)
                if handle is not None:  # its .part file stays unserved until the sweep deletes it
                    with contextlib.suppress(OSError):
                        handle.close()
        for side, handle in handles.items():
            try:
                self.store.commit(self.session_id, side, handle)
                self.metrics.recordings.labels(side=side).inc()
            except OSError as exc:
                log.warning("recording %s (%s) not finished: %s", self.session_id, side, exc)
                self.metrics.recording_errors.labels(reason="write").inc()


def start_recording(
    store: RecordingStore | None,
    consent: bool,
    session_id: str,
    audio_format: str,
    metrics: RuntimeMetrics,
) -> SessionRecorder | None:
    """The recorder of a session that starts now: one when the caller consented (``consent``: the token's
    ``recording_consent``) and the node records (``store``), else None. Never raises: a recorder that
    cannot start is logged and counted (``reason="write"``), and the session goes on unrecorded."""
    if store is None or not consent:
        return None
    try:
        return SessionRecorder(store, session_id, audio_format, metrics)
    except (ValueError, RuntimeError) as exc:
        log.warning("recording of session %s not started: %s", session_id, exc)
        metrics.recording_errors.labels(reason="write").inc()
        return None
