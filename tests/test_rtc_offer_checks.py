"""The offer checks made before anything is reserved (issue 34, item 11): on a real aiortc offer, each
defect aiortc accepts and fails on later is refused with what is wrong."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiortc import RTCPeerConnection

from runtime.frontend.transports.webrtc.offer_checks import OfferInvalid, check_offer


@pytest.fixture(scope="module")
def offer() -> str:
    async def make() -> str:
        caller = RTCPeerConnection()
        caller.addTransceiver("audio", direction="sendrecv")
        caller.createDataChannel("duplex")
        await caller.setLocalDescription(await caller.createOffer())
        sdp = caller.localDescription.sdp
        await caller.close()
        return sdp

    return asyncio.run(make())


def test_a_browser_shaped_offer_passes(offer: str) -> None:
    assert "a=group:BUNDLE 0 1" in offer
    check_offer(offer)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda s: s.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0 7"), "BUNDLE"),
        (lambda s: s.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0 0 1"), "BUNDLE"),
        (lambda s: re.sub(r"(?m)^a=fingerprint:.*\r?\n", "", s), "has no a=fingerprint"),
        (lambda s: re.sub(r"(?m)^a=fingerprint:\S+", "a=fingerprint:md5", s), "'md5'"),
        (lambda s: re.sub(r"(?m)^a=ice-ufrag:.*\r?\n", "", s), "ice-ufrag"),
        (lambda s: re.sub(r"(?m)^a=ice-pwd:.*\r?\n", "", s), "ice-pwd"),
        (lambda s: re.sub(r"(?m)^a=mid:1\r?$", "a=mid:0\r", s), "m-lines share a=mid:0"),
        (lambda s: re.sub(r"(?m)^a=mid:0\r?\n", "", s, count=1), "has 0 a=mid lines"),
    ],
    ids=[
        "bundle-unknown-mid",
        "bundle-twice",
        "no-fingerprint",
        "md5",
        "no-ufrag",
        "no-pwd",
        "dup-mid",
        "no-mid",
    ],
)
def test_each_defect_is_named(offer: str, mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    broken = mutate(offer)
    assert broken != offer
    with pytest.raises(OfferInvalid, match=re.escape(needle)):
        check_offer(broken)
