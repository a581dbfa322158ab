"""Session recordings, with the caller's consent: both sides of a conversation as Ogg Opus files.

A session whose token carries ``recording_consent: true`` (``runtime.frontend.gate.tokens``) on a node with
``DUPLEX_RECORDING_DIR`` gets a :class:`SessionRecorder`. The session hands it frames, not wire payloads:
:meth:`SessionRecorder.caller` with each ``[1920]`` float32 frame it gives the slot (after the handshake)
and :meth:`SessionRecorder.agent` with each frame the engine produced and the transport sent: a queue put,
never a wait. One thread per recorder encodes each side to Ogg Opus (PyAV's libopus at
:data:`RECORDING_COMPLEXITY`, which releases the GIL; sphn when PyAV is missing), off the audio path. So a
recording is right whatever the transport and its codec (Kyutai's Ogg/Opus or PCM on the WebSocket, RTP
Opus on WebRTC): issue 31, where a WebRTC session's float32 bytes were recorded as Int16.

If the thread falls behind by :data:`QUEUE_FRAMES` frames, further frames are left out of the
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
from runtime.frontend.codecs.kyutai_audio import FrameEncoder, OpusFrameEncoder, PyavOpusFrameEncoder
from runtime.metrics import RuntimeMetrics

__all__ = [
    "OGG_OPUS_CONTENT_TYPE",
    "QUEUE_FRAMES",
    "RECORDING_COMPLEXITY",
    "SESSION_ID_RE",
    "SIDES",
    "LocalRecordings",
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
QUEUE_FRAMES = 500
"""Frames (both sides) a recorder may hold before its thread writes them: 500 x 80 ms, 20 s of a call."""
RECORDING_COMPLEXITY = 5
"""libopus complexity for encoding recordings (0.6 ms per 80 ms frame, measured on this project's build
host with PyAV's libopus)."""

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


_FILE_MODE = 0o600
"""Recording files: owner read and write only."""


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
        # 0600 whatever the umask: a recording is the caller's voice, read by the runtime alone (issue 34:
        # files were created 0644). O_TRUNC as "wb" did; the rename in commit keeps the mode.
        descriptor = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
        os.fchmod(descriptor, _FILE_MODE)  # an existing .part file keeps its old mode through os.open
        return os.fdopen(descriptor, "wb")

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


def _frame_encoder() -> FrameEncoder:
    """One side's Ogg Opus encoder: PyAV's libopus at :data:`RECORDING_COMPLEXITY` with its true pre-skip
    (312 samples at 48 kHz: a player drops the codec's look-ahead, not the first 80 ms as sphn's header
    made it), sphn without PyAV."""
    try:
        return PyavOpusFrameEncoder(RECORDING_COMPLEXITY, true_pre_skip=True)
    except ImportError:  # PyAV is a dependency of the runtime; sphn as a last resort
        return OpusFrameEncoder()


class SessionRecorder:
    """One session's recording (see the module doc): two sides, one writer thread, a bounded queue.

    Args:
        store: where the files go.
        session_id: the session (32 hex digits).
        metrics: ``duplex_recordings_total``, ``duplex_recording_bytes_total``, ``..._errors_total``.
        max_queue: frames held before further ones are left out.

    Raises:
        ValueError: a bad session id.
    """

    def __init__(
        self,
        store: RecordingStore,
        session_id: str,
        metrics: RuntimeMetrics,
        *,
        max_queue: int = QUEUE_FRAMES,
    ) -> None:
        _check(session_id, SIDES[0])
        self.store = store
        self.session_id = session_id
        self.metrics = metrics
        self.bytes_written = dict.fromkeys(SIDES, 0)
        self._queue: queue.Queue[tuple[str, np.ndarray] | None] = queue.Queue(max_queue)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"recorder {session_id[:8]}", daemon=True)
        self._thread.start()

    def caller(self, frame: np.ndarray) -> None:
        """One ``[1920]`` float32 frame the caller gave the slot (copied; never blocks, never raises)."""
        self._put("caller", frame)

    def agent(self, frame: np.ndarray) -> None:
        """One ``[1920]`` float32 frame the engine produced for the caller (copied; never blocks, never
        raises)."""
        self._put("agent", frame)

    def _put(self, side: str, frame: np.ndarray) -> None:
        if self._closing:
            return
        try:
            self._queue.put_nowait((side, np.array(frame, dtype=np.float32).reshape(-1)))
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
        coders: dict[str, FrameEncoder] = {}
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
            side, frame = item
            if side in failed:
                continue
            try:
                if side not in handles:
                    coders[side] = _frame_encoder()
                    handles[side] = self.store.create(self.session_id, side)
                if frame.size != FRAME_SAMPLES:  # a frame is [1920]: anything else is a caller's bug
                    raise ValueError(f"a recorded frame must hold {FRAME_SAMPLES} samples, got {frame.size}")
                data = coders[side].encode(frame)
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
    metrics: RuntimeMetrics,
) -> SessionRecorder | None:
    """The recorder of a session that starts now: one when the caller consented (``consent``: the token's
    ``recording_consent``) and the node records (``store``), else None. Never raises: a recorder that
    cannot start is logged and counted (``reason="write"``), and the session goes on unrecorded."""
    if store is None or not consent:
        return None
    try:
        return SessionRecorder(store, session_id, metrics)
    except (ValueError, RuntimeError) as exc:
        log.warning("recording of session %s not started: %s", session_id, exc)
        metrics.recording_errors.labels(reason="write").inc()
        return None
