"""A user-space UDP impairment relay for WebRTC tests (this kernel has no netem): both peers' ICE candidates
are rewritten to the relay's one address, and the relay forwards between them, dropping, delaying and so
reordering the client's RTP packets on the way to the server. STUN, DTLS and RTCP pass unharmed (RFC 7983's
first-byte demultiplexing; RTCP by its packet type, RFC 5761), so the call connects as usual.
"""

from __future__ import annotations

import asyncio
import random
import re

__all__ = ["ImpairedRelay", "route_through"]

_CANDIDATE = re.compile(r"(?m)^a=candidate:(\S+) (\d) udp (\d+) (\d+\.\d+\.\d+\.\d+) (\d+) typ host.*$")


def route_through(sdp: str, relay: tuple[str, int]) -> tuple[str, tuple[str, int]]:
    """``sdp`` with its candidates replaced by one host candidate at ``relay``, and the address of the
    first IPv4 UDP host candidate it had (where the relay must forward).

    Raises:
        ValueError: no IPv4 UDP host candidate in ``sdp``.
    """
    match = _CANDIDATE.search(sdp)
    if match is None:
        raise ValueError("no IPv4 UDP host candidate in the SDP")
    real = (match.group(4), int(match.group(5)))
    line = f"a=candidate:{match.group(1)} 1 udp {match.group(3)} {relay[0]} {relay[1]} typ host"
    lines = [ln for ln in sdp.split("\r\n") if not ln.startswith("a=candidate:")]
    out, placed = [], False
    for ln in lines:
        out.append(ln)
        if ln.startswith("a=ice-pwd:") and not placed:
            out.append(line)
            placed = True
    return "\r\n".join(out), real


class ImpairedRelay(asyncio.DatagramProtocol):
    """Forwards between ``client`` and ``server`` (set once the SDPs are known) through one socket.

    Client -> server RTP: dropped with probability ``loss``, delayed uniformly in ``[0, jitter_s]``, and with
    probability ``reorder`` delayed a further ``reorder_s`` (so it lands behind the next packet).

    Attributes:
        rtp_forwarded, rtp_dropped: client RTP packets passed on and dropped.
    """

    def __init__(
        self, *, loss: float, jitter_s: float, reorder: float, reorder_s: float = 0.025, seed: int = 22
    ) -> None:
        self.loss = loss
        self.jitter_s = jitter_s
        self.reorder = reorder
        self.reorder_s = reorder_s
        self.rng = random.Random(seed)
        self.client: tuple[str, int] | None = None
        self.server: tuple[str, int] | None = None
        self.transport: asyncio.DatagramTransport | None = None
        self.rtp_forwarded = 0
        self.rtp_dropped = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    @property
    def address(self) -> tuple[str, int]:
        assert self.transport is not None
        return self.transport.get_extra_info("sockname")[:2]  # type: ignore[no-any-return]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        if addr == self.server:
            if self.client is not None:
                self.transport.sendto(data, self.client)
            return
        if self.client is None or addr != self.client or self.server is None:
            return
        if len(data) > 1 and 128 <= data[0] <= 191 and not 192 <= data[1] <= 223:  # RTP, not RTCP
            if self.rng.random() < self.loss:
                self.rtp_dropped += 1
                return
            delay = self.rng.uniform(0, self.jitter_s)
            if self.rng.random() < self.reorder:
                delay += self.reorder_s
            self.rtp_forwarded += 1
            asyncio.get_running_loop().call_later(delay, self._send, data, self.server)
            return
        self.transport.sendto(data, self.server)

    def _send(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(data, addr)

    @classmethod
    async def open(cls, host: str, **kwargs: float) -> ImpairedRelay:
        """A relay listening on ``host`` (an ephemeral port)."""
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_datagram_endpoint(lambda: cls(**kwargs), local_addr=(host, 0))
        return protocol

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
