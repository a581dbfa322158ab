"""A WebRTC caller that leaves while its ``POST /api/rtc`` waits in the waiting room: when a slot frees, the
node sees the POST's connection gone and gives the slot back at once, spending nothing, instead of answering
nobody and holding the slot until ``DUPLEX_RTC_CONNECT_TIMEOUT_S`` (aiohttp runs a handler to its end after
its client left). The connect timeout is set far beyond the hang guard, so only the fix frees the slot.

Planted bug: ``_answer`` without its ``client_gone()`` check fails here ("every session gone and every slot
free" times out: the slot stays with the answered call that nobody will connect).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from test_access_control import token
from test_rtc import all_free, rtc_settings, url
from test_server_e2e import WAIT_S, bundle, running_server, speech, wait_until  # noqa: F401  (fixtures)

from runtime.tools.rtc_client import RtcCall, encode_packets

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def packets(speech: list[np.ndarray]) -> list[bytes]:  # noqa: F811
    return encode_packets(speech[0])


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_a_caller_that_left_the_waiting_room_gets_no_slot(bundle, http, packets) -> None:  # noqa: F811
    settings = rtc_settings(rtc_connect_timeout_s=120.0, waiting_room_size=4, waiting_room_s=120.0)
    async with running_server(bundle, workers=0, max_sessions=1, **settings) as server:
        holder = RtcCall(url(server), packets, token=token())
        try:
            assert (await holder.start(http)).status == 201
            await asyncio.wait_for(holder.audio_arrived.wait(), WAIT_S)
            # The second caller POSTs its offer over its own connection and waits for a slot ...
            leaver = RtcCall(url(server), packets)
            body = (await leaver.offer()).encode()
            await leaver.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                f"POST /api/rtc HTTP/1.1\r\nHost: test\r\nContent-Type: application/sdp\r\n"
                f"Authorization: Bearer {token()}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            await wait_until(
                lambda: server.backend.status().waiting == 1, timeout_s=WAIT_S, what="the caller waiting"
            )
            # ... and leaves before one frees.
            writer.close()
            await writer.wait_closed()
            assert reader.at_eof() or not await reader.read(1)  # nothing was answered
            assert await holder.hang_up(http) == 200
        finally:
            await holder.close()
        await all_free(server)  # the slot went to the waiting caller, who had left: given back at once
        assert server.backend.status().waiting == 0
        ended = server.metrics.registry.get_sample_value(
            "duplex_sessions_ended_total", {"reason": "client_closed"}
        )
        assert ended is not None and ended >= 1
        # and the node still answers the next caller
        after = RtcCall(url(server), packets, token=token())
        try:
            assert (await after.start(http)).status == 201
            await asyncio.wait_for(after.audio_arrived.wait(), WAIT_S)
        finally:
            await after.close()
        await all_free(server)
