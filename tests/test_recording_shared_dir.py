"""The recorder on a directory shared by every pod of a region, as the multi-region stack's recordings bucket
is (mounted by Cloud Storage FUSE in each runtime pod: docs/sessions-api.md, "Recording").

What differs from a node's own disk, and matters to the recorder (GoogleCloudPlatform/gcsfuse,
semantics.md): a new file is written locally (staged, or streamed into an unfinished upload) and becomes
an object, visible to the other mounts, only when it is closed. So the ``.part`` file of a recording in
progress on pod A does not exist for pod B. ``SharedBucket`` below behaves that way: each "mount" writes
into its own staging folder and publishes the file into the shared folder on close. What gcsfuse does
support the recorder relies on (renaming a closed file: a copy and a delete, not atomic on a flat bucket;
appending sequentially to a new file; mtime; deleting; listing) plain files do too.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.frontend.store.recordings import LocalRecordings, SessionRecorder
from runtime.metrics import RuntimeMetrics

SID = "0123456789abcdef0123456789abcdef"
WAIT_S = 30.0
"""Hang guard of the recorder thread's join (s): generous, for a loaded 2-core machine."""


class _UploadOnClose:
    """A file being written on one mount: local until ``close``, which publishes it (gcsfuse's upload)."""

    def __init__(self, staged: Path, published: Path, before_close: threading.Event | None) -> None:
        self._file = open(staged, "wb")  # noqa: SIM115 (closed in close)
        self._staged, self._published, self._before_close = staged, published, before_close

    def write(self, data: bytes) -> int:
        return self._file.write(data)

    def close(self) -> None:
        if self._before_close is not None:
            assert self._before_close.wait(WAIT_S), "the test never let the recorder finish"
        self._file.close()
        os.replace(self._staged, self._published)


class SharedBucket(LocalRecordings):
    """One pod's mount of a shared folder: files in progress are invisible to the other mounts until closed
    (``hold`` keeps a close waiting, to put another pod's erase before it)."""

    def __init__(self, shared: Path, staging: Path, hold: threading.Event | None = None) -> None:
        super().__init__(shared)
        staging.mkdir(parents=True, exist_ok=True)
        self.staging, self.hold = staging, hold

    def create(self, session_id: str, side: str) -> Any:
        final = self._path(session_id, side)
        name = final.name + ".part"
        return _UploadOnClose(self.staging / name, self.directory / name, self.hold)


def _frames(seconds: float = 1.0) -> list[np.ndarray]:
    """A tone as [1920] float32 frames (80 ms each)."""
    count = int(round(seconds / 0.08))
    pcm = (0.3 * np.sin(np.arange(count * FRAME_SAMPLES) / 7)).astype(np.float32)
    return list(pcm.reshape(count, FRAME_SAMPLES))


def _files(folder: Path, session_id: str = SID) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(session_id))


def test_a_recording_finished_on_one_pod_is_served_by_every_pod(tmp_path: Path) -> None:
    shared = tmp_path / "bucket"
    pod_a = SharedBucket(shared, tmp_path / "a")
    pod_b = LocalRecordings(shared)
    recorder = SessionRecorder(pod_a, SID, RuntimeMetrics())
    for frame in _frames():
        recorder.caller(frame)
        recorder.agent(frame)
    recorder.close()
    assert recorder.join(WAIT_S)
    for side in ("caller", "agent"):
        path = pod_b.local_path(SID, side)
        assert path is not None and path.read_bytes()[:4] == b"OggS"
        assert path.stat().st_size == recorder.bytes_written[side] > 0
    assert _files(shared) == [f"{SID}.agent.opus", f"{SID}.caller.opus"]


def test_an_erase_on_another_pod_before_the_upload_still_erases(tmp_path: Path) -> None:
    """The session has ended (the API allows the erase) but pod A's recorder has not closed its files yet:
    pod B sees nothing to delete. Without the erase marker the recording would appear after the 204."""
    shared, hold = tmp_path / "bucket", threading.Event()
    pod_a = SharedBucket(shared, tmp_path / "a", hold)
    pod_b = LocalRecordings(shared)
    metrics = RuntimeMetrics()
    recorder = SessionRecorder(pod_a, SID, metrics)
    for frame in _frames():
        recorder.caller(frame)
    recorder.close()
    deadline = time.monotonic() + WAIT_S
    while not any((tmp_path / "a").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread has created its (staged) file
    assert pod_b.erase(SID) == 0  # nothing visible from pod B yet
    hold.set()
    assert recorder.join(WAIT_S)
    assert pod_b.local_path(SID, "caller") is None and pod_a.local_path(SID, "caller") is None
    assert _files(shared) == [f"{SID}.erased"]
    assert pod_b.erase(SID) == 0  # a second erase finds nothing (the API answers 404)


def test_a_rename_left_half_done_is_not_served_after_an_erase(tmp_path: Path) -> None:
    """A flat bucket renames by copy then delete: a final file may show up next to an erase marker (a
    copy that finished after the erase listed the folder). It is not served, and the sweep deletes it."""
    store = LocalRecordings(tmp_path)
    store.erase(SID)
    late = tmp_path / f"{SID}.caller.opus"
    late.write_bytes(b"OggS")
    assert store.local_path(SID, "caller") is None
    past = time.time() - 7200
    for path in tmp_path.iterdir():
        os.utime(path, (past, past))
    assert store.sweep(3600) == 1  # the recording; the marker goes too, uncounted
    assert list(tmp_path.iterdir()) == []


def test_two_pods_sweeping_at_once_delete_each_file_once(tmp_path: Path) -> None:
    pods = [LocalRecordings(tmp_path), LocalRecordings(tmp_path)]
    ids = [f"{i:032x}" for i in range(40)]
    past = time.time() - 7200
    for session_id in ids:
        for name in (f"{session_id}.caller.opus", f"{session_id}.agent.opus.part"):
            (tmp_path / name).write_bytes(b"OggS")
            os.utime(tmp_path / name, (past, past))
    counts: list[int] = []
    threads = [threading.Thread(target=lambda p=pod: counts.append(p.sweep(3600))) for pod in pods]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert sum(counts) == 2 * len(ids) and list(tmp_path.iterdir()) == []


def test_a_file_the_sweep_cannot_delete_does_not_stop_it(tmp_path: Path, monkeypatch: Any) -> None:
    """An object store can refuse one delete (a stale handle, a transient error): the sweep logs it and
    deletes the rest; the file waits for the next sweep."""
    store = LocalRecordings(tmp_path)
    past = time.time() - 7200
    names = [f"{i:032x}.caller.opus" for i in range(3)]
    for name in names:
        (tmp_path / name).write_bytes(b"OggS")
        os.utime(tmp_path / name, (past, past))
    real_unlink = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith(names[1]):
            raise OSError(116, "Stale file handle")
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    assert store.sweep(3600) == 2
    assert [p.name for p in tmp_path.iterdir()] == [names[1]]
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert store.sweep(3600) == 1


@pytest.mark.parametrize("bad", ["../" + SID, SID.upper(), ""])
def test_erase_refuses_bad_ids_before_touching_the_folder(tmp_path: Path, bad: str) -> None:
    store = LocalRecordings(tmp_path)
    with pytest.raises(ValueError, match="32 lowercase hex"):
        store.erase(bad)
    assert list(tmp_path.iterdir()) == []
