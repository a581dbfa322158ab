"""Run by tests/test_carrier_peers.py with .venv-peers' Python (``make peers-deps``): pipecat-ai's carrier
serializers (``TwilioFrameSerializer``, ``PlivoFrameSerializer``, ``TelnyxFrameSerializer``,
``ExotelFrameSerializer``),
implementations nobody here wrote, read the messages our load generator sent as the carrier and write the
messages a bridge sends the carrier, for the test to compare with our node's.

stdin: ``{"carrier": "twilio" | "plivo" | "telnyx" | "exotel", "sent": [the carrier's messages], "stream_sid":
"<stream id>"}``. stdout: one JSON object: ``{"parsed": [{"event", "frame", "samples", "rate", "digit"} per
message], "wrote": {"media": {...}, "clear": {...}}}``.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from pipecat.frames.frames import InputAudioRawFrame, InputDTMFFrame, InterruptionFrame, OutputAudioRawFrame
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.serializers.exotel import ExotelFrameSerializer
from pipecat.serializers.plivo import PlivoFrameSerializer
from pipecat.serializers.telnyx import TelnyxFrameSerializer
from pipecat.serializers.twilio import TwilioFrameSerializer


def _serializer(
    carrier: str, stream_id: str
) -> TwilioFrameSerializer | PlivoFrameSerializer | TelnyxFrameSerializer | ExotelFrameSerializer:
    if carrier == "exotel":
        return ExotelFrameSerializer(stream_id, params=ExotelFrameSerializer.InputParams(sample_rate=8000))
    if carrier == "telnyx":
        return TelnyxFrameSerializer(
            stream_id,
            outbound_encoding="PCMU",
            inbound_encoding="PCMU",
            params=TelnyxFrameSerializer.InputParams(auto_hang_up=False, sample_rate=8000),
        )
    if carrier == "plivo":
        return PlivoFrameSerializer(
            stream_id, params=PlivoFrameSerializer.InputParams(auto_hang_up=False, sample_rate=8000)
        )
    return TwilioFrameSerializer(
        stream_id, params=TwilioFrameSerializer.InputParams(auto_hang_up=False, sample_rate=8000)
    )


async def main() -> None:
    request = json.load(sys.stdin)
    serializer = _serializer(request.get("carrier", "twilio"), request["stream_sid"])
    await serializer.setup(FrameProcessorSetup.__new__(FrameProcessorSetup))
    parsed = []
    for message in request["sent"]:
        frame = await serializer.deserialize(json.dumps(message))
        row = {"event": message.get("event"), "frame": type(frame).__name__ if frame is not None else None}
        if isinstance(frame, InputAudioRawFrame):
            row.update(samples=len(frame.audio) // 2, rate=frame.sample_rate)
        if isinstance(frame, InputDTMFFrame):
            row["digit"] = frame.button.value
        parsed.append(row)
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(1920) / 24000) * 32767).astype("<i2").tobytes()
    media = None
    for _ in range(10):  # its stream resampler holds the first chunk back
        media = media or await serializer.serialize(
            OutputAudioRawFrame(audio=tone, sample_rate=24000, num_channels=1)
        )
    clear = await serializer.serialize(InterruptionFrame())
    print(json.dumps({"parsed": parsed, "wrote": {"media": json.loads(media), "clear": json.loads(clear)}}))


asyncio.run(main())
