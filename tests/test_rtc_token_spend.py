"""When a WebRTC session spends its token (issue 22, item 6): when ICE and DTLS connect, not when the answer
is sent. An answered offer whose ICE never connects (DELETEd, or timed out) leaves the token for the
browser client's WebSocket fallback; a connected call's token is spent; and of an answered-but-unconnected
call and a WebSocket session holding one token, at most one carries on. Both spend paths: the front end's
replay guard (``--workers 0``) and the engine's ledger (``--workers 2`` with ``token_replay_check=memory``).
An aiortc client (runtime/tools/rtc_client.py) against the in-process server on loopback, the ``sim`` model.
"""

from __future__ import annotations

import asyncio

import pytest
from test_access_control import token
from test_rtc import _never, all_free, http, node, packets, url  # noqa: F401  (fixtures)
from test_server_e2e import WAIT_S, bundle, chat_url, live, speech, wait_until  # noqa: F401  (fixtures)

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.tools.loadgen import run_session
from runtime.tools.rtc_client import RtcCall

pytestmark = pytest.mark.asyncio(loop_scope="module")


def ended(server, reason: str) -> float:
    return server.metrics.sessions_ended.labels(reason=reason)._value.get()


async def assert_websocket_session(server, value: str, speech) -> None:  # noqa: F811
    """A WebSocket session with token ``value`` is admitted and gets audio; the token is then spent."""
    async with live(chat_url(server), speech[0], token=value) as client:
        assert client.result.handshake, (client.result.errors, client.result.close_code)
        client.start_streaming()
        await client.wait_audio(2)
        result = await client.finish(tail_s=0.3)
    assert result.errors == [], result.errors
    await assert_spent(server, value, speech)
    await all_free(server)


async def assert_spent(server, value: str, speech) -> None:  # noqa: F811
    """A WebSocket session with token ``value`` is refused as replayed: before the upgrade (403) where the
    front end spends tokens, after it (0x05, 1008) where the engine does (``--workers 2``, ``memory``)."""
    result = await run_session(chat_url(server), speech[1][: FRAME_SAMPLES * 4], token=value)
    assert result.refused and "already used" in result.refusal_reason, result.refusal_reason


async def test_an_answered_offer_that_never_connects_leaves_its_token_for_the_websocket(
    node,  # noqa: F811
    http,  # noqa: F811
    packets,  # noqa: F811
    speech,  # noqa: F811
) -> None:
    # The browser client's fallback: ICE fails after the answer, it DELETEs the session, then /api/chat.
    value = token()
    call = RtcCall(url(node), packets, token=value)
    call.pc.setRemoteDescription = _never  # type: ignore[method-assign]  # ICE never connects
    try:
        assert (await call.start(http)).status == 201
        assert await call.hang_up(http) == 200
    finally:
        await call.close()
    await all_free(node)
    await assert_websocket_session(node, value, speech)
    # No DELETE: the session ends after rtc_connect_timeout_s, its token unspent.
    value = token()
    before = ended(node, "rtc_connect_timeout")
    call = RtcCall(url(node), packets, token=value)
    call.pc.setRemoteDescription = _never  # type: ignore[method-assign]
    try:
        assert (await call.start(http)).status == 201
        await all_free(node)
        assert ended(node, "rtc_connect_timeout") == before + 1
    finally:
        await call.close()
    await assert_websocket_session(node, value, speech)


async def test_a_connected_call_spends_its_token(node, http, packets, speech) -> None:  # noqa: F811
    value = token()
    call = RtcCall(url(node), packets, token=value)
    try:
        assert (await call.start(http)).status == 201
        await asyncio.wait_for(call.handshake.wait(), WAIT_S)
        await asyncio.wait_for(call.audio_arrived.wait(), WAIT_S)
        await assert_spent(node, value, speech)
        again = RtcCall(url(node), packets, token=value)
        outcome = await again.start(http)
        assert outcome.status == 403 and "already used" in outcome.body
        assert call.outcome.errors == []
    finally:
        await call.close()
    await all_free(node)


async def test_an_unconnected_call_and_a_websocket_with_one_token_make_one_conversation(
    node,  # noqa: F811
    http,  # noqa: F811
    packets,  # noqa: F811
    speech,  # noqa: F811
) -> None:
    value = token()
    gate = asyncio.Event()
    call = RtcCall(url(node), packets, token=value)
    apply = call.pc.setRemoteDescription

    async def held(description) -> None:  # the answer is applied (ICE starts) only when the gate opens
        await gate.wait()
        await apply(description)

    call.pc.setRemoteDescription = held  # type: ignore[method-assign]
    replayed = ended(node, "replayed")
    starting = asyncio.create_task(call.start(http))
    try:
        await wait_until(lambda: call.outcome.status == 201, timeout_s=WAIT_S, what="the answer")
        async with live(chat_url(node), speech[0], token=value) as client:
            assert client.result.handshake, (client.result.errors, client.result.close_code)
            client.start_streaming()
            await client.wait_audio(2)
            gate.set()  # now the call connects, and finds its token spent by the WebSocket session
            await asyncio.wait_for(starting, WAIT_S)
            await asyncio.wait_for(call.connected.wait(), WAIT_S)
            await wait_until(
                lambda: ended(node, "replayed") == replayed + 1, timeout_s=WAIT_S, what="the call refused"
            )
            mark = client.mark()
            await client.wait_audio(4, after=mark)  # the WebSocket session carries on
            result = await client.finish(tail_s=0.3)
        assert result.errors == [], result.errors
        assert not call.handshake.is_set() and not call.audio_arrived.is_set()
        assert all("replayed" in error for error in call.outcome.errors), call.outcome.errors
    finally:
        gate.set()
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await call.close()
    await all_free(node)


async def test_one_token_holds_one_connecting_call_at_a_time(
    node,  # noqa: F811
    http,  # noqa: F811
    packets,  # noqa: F811
) -> None:
    """A token is spent only when its call connects, so without a cap one token could hold a slot per POST
    until each call's connect timeout (every slot, from one token and a few offers). A second offer with a
    token whose call is still connecting gets 429 and takes no slot; once that call has ended, the token
    makes a call again.

    Planted bug it catches: no cap (the second offer is answered 201 and holds a second slot)."""
    value = token()
    first = RtcCall(url(node), packets, token=value)
    first.pc.setRemoteDescription = _never  # type: ignore[method-assign]  # never connects
    second = RtcCall(url(node), packets, token=value)
    second.pc.setRemoteDescription = _never  # type: ignore[method-assign]
    try:
        assert (await first.start(http)).status == 201
        free = node.backend.status().free_slots
        refused = await second.start(http)
        assert refused.status == 429 and "still connecting" in refused.body, (refused.status, refused.body)
        assert node.backend.status().free_slots == free  # the refused offer took no slot
        assert await first.hang_up(http) == 200
        await all_free(node)
        third = RtcCall(url(node), packets, token=value)
        third.pc.setRemoteDescription = _never  # type: ignore[method-assign]
        try:
            assert (await third.start(http)).status == 201
            assert await third.hang_up(http) == 200
        finally:
            await third.close()
    finally:
        await first.close()
        await second.close()
    await all_free(node)
