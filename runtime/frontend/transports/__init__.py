"""The transports a conversation runs over: Kyutai's WebSocket protocol (``transports.websocket``) and
WebRTC (``transports.webrtc``). A transport is its edges only: it parses its wire, sends, and closes."""
