"""Issue 33, slot-aware admission at the edge, on one node over the fake backend: a full node stays ready
(``/readyz`` 200) while ``/slotz`` says it has no free slot; every answer carries the ORCA load report
(``endpoint-load-metrics``) with the slots in use; with ``full_before_upgrade`` a ``/api/chat`` upgrade that
finds no slot is answered 503 ``node_full`` with ``Retry-After`` before the upgrade (what the global entry's
retry policy retries), and an upgrade admitted but not yet holding a slot counts against the next one."""

from __future__ import annotations

import json

import pytest
from fake_backend import FakeBackend
from test_frontend_seam import chat, fake_node, get
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runtime.config import RuntimeConfig
from runtime.engine.api import BackendStatus
from runtime.frontend.codecs.protocol import MessageKind
from runtime.frontend.gate.slot_load import LOAD_REPORT_HEADER, SLOTZ_PATH, SlotLoad, load_report
from runtime.frontend.http import ROUTES

UTILIZATION = "named_metrics.slot_utilization"


def _utilization(headers: dict[str, str]) -> float:
    return load_report(headers[LOAD_REPORT_HEADER])[UTILIZATION]


async def test_a_full_node_stays_ready_and_slotz_says_full() -> None:
    """On the old code /readyz turned 503 "node full" with the last slot taken (the pod left the NEG)."""
    async with fake_node(FakeBackend(slots=1)) as server:
        status, headers, body = await get(server, SLOTZ_PATH)
        assert status == 200 and json.loads(body)["free_slots"] == 1, body
        assert _utilization(headers) == 0.0
        async with connect(chat(server)) as client:
            assert await client.recv() == bytes([MessageKind.HANDSHAKE])
            status, headers, body = await get(server, "/readyz")
            assert status == 200 and json.loads(body)["ready"] is True, body
            assert _utilization(headers) == 1.0
            status, headers, body = await get(server, SLOTZ_PATH)
            slotz = json.loads(body)
            assert status == 503, body
            assert (slotz["ready"], slotz["slots"], slotz["in_use"], slotz["free_slots"]) == (True, 1, 1, 0)
            assert slotz["slot_utilization"] == 1.0


async def test_every_answer_reports_the_slot_utilization() -> None:
    async with fake_node(FakeBackend(slots=4)) as server, connect(chat(server)) as client:
        assert await client.recv() == bytes([MessageKind.HANDSHAKE])
        for path in ("/readyz", "/healthz", "/api/personas", SLOTZ_PATH, "/nope"):
            _, headers, _ = await get(server, path)
            assert headers[LOAD_REPORT_HEADER] == "TEXT named_metrics.slot_utilization=0.25", path


async def test_a_full_node_answers_503_before_the_upgrade_when_told_to() -> None:
    """On the old code the second caller was upgraded (101) and refused after it (0x05, 1013): nothing a
    load balancer can retry."""
    async with fake_node(FakeBackend(slots=1), full_before_upgrade=True) as server:
        async with connect(chat(server)) as first:
            assert await first.recv() == bytes([MessageKind.HANDSHAKE])
            with pytest.raises(InvalidStatus) as refused:
                async with connect(chat(server)):
                    pass
            answer = refused.value.response
            assert answer.status_code == 503
            assert answer.headers["Retry-After"] == "5"
            assert answer.body is not None and answer.body.startswith(b"node_full: ")
            assert _utilization(dict(answer.headers)) == 1.0
        assert server.upgrades.count == 0


async def test_a_phone_carriers_stream_to_a_full_node_gets_the_same_503_before_the_upgrade() -> None:
    """A carrier's media stream (Telnyx here: its secret in the URL) is balanced like ``/api/chat``: on a
    full multi-region pod it gets 503 ``node_full`` with ``Retry-After`` before the upgrade, so the global
    entry retries it on another pod. Before, it was upgraded and refused (or waited) on the full pod."""
    token = "telnyx-stream-secret-0123"
    node = fake_node(FakeBackend(slots=1), full_before_upgrade=True, telnyx_stream_token=token)
    async with node as server, connect(chat(server)) as first:
        assert await first.recv() == bytes([MessageKind.HANDSHAKE])
        stream = f"ws://127.0.0.1:{server.port}/api/carriers/telnyx?stream_token={token}"
        with pytest.raises(InvalidStatus) as refused:
            async with connect(stream):
                pass
        answer = refused.value.response
        assert (answer.status_code, answer.headers["Retry-After"]) == (503, "5")
        assert answer.body is not None and answer.body.startswith(b"node_full: ")


async def test_without_the_setting_a_full_node_refuses_after_the_upgrade() -> None:
    async with fake_node(FakeBackend(slots=1)) as server, connect(chat(server)) as first:
        assert await first.recv() == bytes([MessageKind.HANDSHAKE])
        async with connect(chat(server)) as second:
            error = await second.recv()
            assert isinstance(error, bytes) and error[0] == MessageKind.ERROR
            with pytest.raises(ConnectionClosed) as closed:
                await second.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013


async def test_an_upgrade_not_yet_holding_a_slot_counts_against_the_next() -> None:
    async with fake_node(FakeBackend(slots=1), full_before_upgrade=True) as server:
        held = server.upgrades.reserve()  # an upgrade between its check and its slot
        _, headers, _ = await get(server, SLOTZ_PATH)
        assert _utilization(headers) == 1.0
        with pytest.raises(InvalidStatus) as refused:
            async with connect(chat(server)):
                pass
        assert refused.value.response.status_code == 503
        held.release()
        held.release()  # idempotent
        assert server.upgrades.count == 0
        async with connect(chat(server)) as client:
            assert await client.recv() == bytes([MessageKind.HANDSHAKE])
            assert server.upgrades.count == 0  # released once the session held its slot


def _status(slots: int, free: int, waiting: int = 0) -> BackendStatus:
    return BackendStatus(loaded=True, slots=slots, free_slots=free, waiting=waiting, tick_alive=True)


def test_the_waiting_room_takes_upgrades_until_it_is_full() -> None:
    config = RuntimeConfig(waiting_room_s=30, waiting_room_size=2)
    assert SlotLoad.of(_status(2, 0), upgrading=0).takes_upgrade(config)
    assert SlotLoad.of(_status(2, 0, waiting=1), upgrading=1).takes_upgrade(config)  # one place left
    assert SlotLoad.of(_status(2, 0, waiting=2), upgrading=2).takes_upgrade(config) is False
    assert SlotLoad.of(_status(2, 0, waiting=0), upgrading=2).takes_upgrade(config) is False  # racing
    assert SlotLoad.of(_status(2, 0)).takes_upgrade(RuntimeConfig()) is False  # no room: 503
    assert SlotLoad.of(_status(2, 1)).takes_upgrade(RuntimeConfig()) is True
    assert SlotLoad.of(_status(2, 1), upgrading=1).takes_upgrade(RuntimeConfig()) is False


def test_the_load_of_a_node_not_serving_is_full() -> None:
    lost = BackendStatus(loaded=True, slots=4, free_slots=4, waiting=0, tick_alive=False, lost=True)
    assert SlotLoad.of(lost).utilization == 1.0
    assert SlotLoad(slots=0, in_use=0, waiting=0).utilization == 1.0
    assert SlotLoad(slots=4, in_use=3, waiting=0, upgrading=3).utilization == 1.0


def test_a_malformed_load_report_names_what_was_wrong() -> None:
    assert load_report("TEXT named_metrics.a=0.5, named_metrics.b=1") == {
        "named_metrics.a": 0.5,
        "named_metrics.b": 1.0,
    }
    with pytest.raises(ValueError, match="the form must be TEXT"):
        load_report("JSON {}")
    with pytest.raises(ValueError, match="is not <key>=<value>"):
        load_report("TEXT named_metrics.a")
    with pytest.raises(ValueError, match="is not a number"):
        load_report("TEXT named_metrics.a=high")


def test_slotz_is_a_route() -> None:
    assert ROUTES[SLOTZ_PATH].methods == ("GET",)


def test_the_global_entry_balances_on_the_metric_the_pods_report() -> None:
    from infra.components.global_entry import SLOT_UTILIZATION_METRIC
    from runtime.frontend.gate.slot_load import SLOT_UTILIZATION

    assert SLOT_UTILIZATION_METRIC == SLOT_UTILIZATION
