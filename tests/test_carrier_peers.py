"""Each carrier's messages, both ways, against an implementation nobody here wrote (issue 32): pipecat-ai's
carrier serializers (PyPI ``pipecat-ai`` 1.14.0, in ``.venv-peers``: ``make peers-deps``, a prerequisite of
``make test``) run by ``tests/pipecat_driver.py``.

- What our load generator sends as Twilio (``runtime.tools.carrier_client``) is what pipecat's
  ``TwilioFrameSerializer`` reads as Twilio's: every ``media`` a 20 ms audio frame at 8 kHz, ``dtmf`` its
  digit.
- What our bridge sends Twilio (``media``, ``clear``) has the shape pipecat's serializer writes for Twilio.
- Plivo likewise with ``PlivoFrameSerializer``: our Plivo side's ``media`` are 20 ms frames at 8 kHz to it,
  its ``dtmf`` a digit; our bridge's ``playAudio`` and ``clearAudio`` have the shape it writes.
- Telnyx likewise with ``TelnyxFrameSerializer`` (PCMU): ``media`` and ``dtmf`` in; ``media`` and ``clear``
  out. Exotel with ``ExotelFrameSerializer`` (16-bit PCM at 8 kHz): the same.

``twilio``'s own ``RequestValidator`` checks the signature side (tests/test_carrier_twilio.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_carrier_twilio import AUTH_TOKEN, STREAM_URL, TWILIO, _TalkingBackend, base, tone_8k
from test_frontend_seam import fake_node

from runtime.tools.carrier_client import carrier_call
from runtime.tools.carrier_sides import TwilioSide

ROOT = Path(__file__).resolve().parents[1]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


def _pipecat(sent: list[dict[str, object]], stream_sid: str, carrier: str = "twilio") -> dict:
    assert PEERS_PYTHON.exists(), "run `make peers-deps` (make test does): the carriers' peer serializers"
    done = subprocess.run(
        [str(PEERS_PYTHON), str(ROOT / "tests" / "pipecat_driver.py")],
        input=json.dumps({"carrier": carrier, "sent": sent, "stream_sid": stream_sid}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _shape(message: object) -> object:
    """The message's keys, nested, without values."""
    if isinstance(message, dict):
        return {key: _shape(value) for key, value in message.items()}
    return type(message).__name__


async def test_pipecat_reads_our_twilio_side_and_writes_what_our_bridge_writes():
    backend = _TalkingBackend(slots=1)
    silence, speech = tone_8k(440, 0.5, amplitude=0.0), tone_8k(440, 0.6)
    import numpy as np

    async with fake_node(backend, **TWILIO) as server:
        call = await carrier_call(
            TwilioSide(),
            base(server),
            np.concatenate([silence, speech]),
            secret=AUTH_TOKEN,
            stream_url=STREAM_URL,
            dtmf=((3, "7"),),
            keep_messages=200,
        )
    assert call.clears == 1 and call.failure == ""
    stream_sid = str(call.sent_messages[1]["streamSid"])
    peer = _pipecat(call.sent_messages, stream_sid)
    events = [(row["event"], row["frame"]) for row in peer["parsed"]]
    assert ("connected", None) in events and ("start", None) in events
    media = [row for row in peer["parsed"] if row["event"] == "media"]
    assert media and all(row["frame"] == "InputAudioRawFrame" for row in media)
    assert {(row["samples"], row["rate"]) for row in media} == {(160, 8000)}  # 20 ms at 8 kHz each
    assert [row["digit"] for row in peer["parsed"] if row["event"] == "dtmf"] == ["7"]
    ours = {m["event"]: m for m in call.received_messages if m["event"] in ("media", "clear")}
    theirs = peer["wrote"]
    assert _shape(ours["media"]) == _shape(theirs["media"])  # {"event", "streamSid", "media": {"payload"}}
    assert _shape(ours["clear"]) == _shape(theirs["clear"])  # {"event", "streamSid"}
    assert ours["media"]["streamSid"] == theirs["media"]["streamSid"] == stream_sid
    assert theirs["clear"] == {"event": "clear", "streamSid": stream_sid} == ours["clear"]


async def test_pipecat_reads_our_plivo_side_and_writes_what_our_bridge_writes():
    import numpy as np
    from test_carrier_plivo import PLIVO, plivo_call

    backend = _TalkingBackend(slots=1)
    silence, speech = tone_8k(440, 0.5, amplitude=0.0), tone_8k(440, 0.6)
    async with fake_node(backend, **PLIVO) as server:
        call = await plivo_call(
            server, np.concatenate([silence, speech]), dtmf=((3, "7"),), keep_messages=200
        )
    assert call.clears == 1 and call.failure == ""
    stream_id = str(call.sent_messages[0]["start"]["streamId"])
    peer = _pipecat(call.sent_messages, stream_id, "plivo")
    media = [row for row in peer["parsed"] if row["event"] == "media"]
    assert media and all(row["frame"] == "InputAudioRawFrame" for row in media)
    assert {(row["samples"], row["rate"]) for row in media} == {(160, 8000)}  # 20 ms at 8 kHz each
    assert [row["digit"] for row in peer["parsed"] if row["event"] == "dtmf"] == ["7"]
    ours = {m["event"]: m for m in call.received_messages if m["event"] in ("playAudio", "clearAudio")}
    theirs = peer["wrote"]
    # {"event", "media": {"contentType", "sampleRate", "payload"}, "streamId"}
    assert _shape(ours["playAudio"]) == _shape(theirs["media"])
    assert {k: v for k, v in ours["playAudio"]["media"].items() if k != "payload"} == {
        k: v for k, v in theirs["media"]["media"].items() if k != "payload"
    }
    assert ours["playAudio"]["streamId"] == theirs["media"]["streamId"] == stream_id
    assert theirs["clear"] == {"event": "clearAudio", "streamId": stream_id} == ours["clearAudio"]


async def test_pipecat_reads_our_telnyx_side_and_writes_what_our_bridge_writes():
    import numpy as np
    from test_carrier_telnyx import TELNYX, telnyx_call

    backend = _TalkingBackend(slots=1)
    silence, speech = tone_8k(440, 0.5, amplitude=0.0), tone_8k(440, 0.6)
    async with fake_node(backend, **TELNYX) as server:
        call = await telnyx_call(
            server, np.concatenate([silence, speech]), dtmf=((3, "7"),), keep_messages=200
        )
    assert call.clears == 1 and call.failure == ""
    stream_id = str(call.sent_messages[1]["stream_id"])
    peer = _pipecat(call.sent_messages, stream_id, "telnyx")
    media = [row for row in peer["parsed"] if row["event"] == "media"]
    assert media and all(row["frame"] == "InputAudioRawFrame" for row in media)
    assert {(row["samples"], row["rate"]) for row in media} == {(160, 8000)}  # 20 ms at 8 kHz each
    assert [row["digit"] for row in peer["parsed"] if row["event"] == "dtmf"] == ["7"]
    ours = {m["event"]: m for m in call.received_messages if m["event"] in ("media", "clear")}
    theirs = peer["wrote"]
    assert _shape(ours["media"]) == _shape(theirs["media"])  # {"event", "media": {"payload"}}
    assert theirs["clear"] == {"event": "clear"} == ours["clear"]


async def test_pipecat_reads_our_exotel_side_and_writes_what_our_bridge_writes():
    import numpy as np
    from test_carrier_exotel import EXOTEL, exotel_call

    backend = _TalkingBackend(slots=1)
    silence, speech = tone_8k(440, 0.5, amplitude=0.0), tone_8k(440, 0.6)
    async with fake_node(backend, **EXOTEL) as server:
        call = await exotel_call(
            server, np.concatenate([silence, speech]), dtmf=((3, "7"),), keep_messages=200
        )
    assert call.clears == 1 and call.failure == ""
    stream_sid = str(call.sent_messages[1]["stream_sid"])
    peer = _pipecat(call.sent_messages, stream_sid, "exotel")
    media = [row for row in peer["parsed"] if row["event"] == "media"]
    assert media and all(row["frame"] == "InputAudioRawFrame" for row in media)
    assert {(row["samples"], row["rate"]) for row in media} == {(160, 8000)}  # 20 ms at 8 kHz each
    assert [row["digit"] for row in peer["parsed"] if row["event"] == "dtmf"] == ["7"]
    ours = {m["event"]: m for m in call.received_messages if m["event"] in ("media", "clear")}
    theirs = peer["wrote"]
    assert _shape(ours["media"]) == _shape(theirs["media"])  # {"event", "stream_sid", "media": {"payload"}}
    assert ours["media"]["stream_sid"] == theirs["media"]["stream_sid"] == stream_sid
    assert theirs["clear"] == {"event": "clear", "stream_sid": stream_sid} == ours["clear"]


def test_the_driver_runs_with_the_peers_python_only():
    """The peers' virtualenv is its own: the project's Python has no pipecat."""
    assert subprocess.run([sys.executable, "-c", "import pipecat"], capture_output=True).returncode != 0
