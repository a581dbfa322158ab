"""WebRTC on ``/api/rtc``: WHIP-shaped signalling, the aiortc peer, its RTP Opus media, the jitter buffer,
and TURN credentials."""
