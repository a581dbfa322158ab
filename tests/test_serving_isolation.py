"""Isolation above the engine (issue 25): every session hears its OWN echo, never a neighbour's.

The sim model (``runtime.engine.sim``) answers each live slot with its own input at half level over a quiet
220 Hz tone (the same tone every frame). Each session here sends a signal no other session sends (a
constant level of its own, or a ramp of constants), so the mean of one output frame, less the tone's, says
whose input frame it echoes. Each session is checked against its own signal, with joins and leaves that
make the slot indices differ from the arrival order (a freed slot is reused by a later arrival).

Two layers: the scheduler's tick loop over the sim engine (``SlotScheduler``: which session's frame goes
into which batch row, which row's output goes to which session), and the whole serving path over the wire
(``DuplexServer`` with PCM clients, ``--workers 0`` over ``LocalSlots`` and ``--workers 2`` over ZeroMQ).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import pytest
from test_server_e2e import (  # noqa: F401 (bundle: fixture)
    WORKER_MODES,
    LiveClient,
    bundle,
    chat_url,
    running_server,
    wait_until,
)

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import SlotScheduler, SlotSession
from runtime.engine.sim import SimEngine
from runtime.engine.sim_timing import StepTime
from runtime.frontend.server import DuplexServer
from runtime.frontend.session.conversation import ChatSession
from runtime.metrics import RuntimeMetrics

SLOTS = 4
BATCH_FRAMES = 6
"""Frames each live session pushes per phase of the scheduler test."""
PCM_SCALE = 32768.0


def echoed_input_mean(pcm: np.ndarray, tone: np.ndarray | float = 0.0) -> float:
    """The mean of the input frame an output frame of the sim echoes: the sim's answer is half the input
    plus its tone, so twice the mean of the output less the tone (``tone``: the sim's, or 0 where the
    tone's own mean, under 0.001, is below the tolerance)."""
    return 2.0 * float(np.mean(pcm - tone, dtype=np.float64))


class _Tokenizer:
    """The two calls the scheduler makes of a sentencepiece tokenizer."""

    def vocab_size(self) -> int:
        return 256

    def id_to_piece(self, token: int) -> str:
        return f"<{token}>"


@dataclass(eq=False)
class _Caller:
    """One session of the scheduler test: the constant frames it sent, the output frames it got."""

    name: str
    index: int
    tone: np.ndarray
    session: SlotSession | None = None
    sent: list[float] = field(default_factory=list)
    heard: list[float] = field(default_factory=list)
    outputs: int = 0

    @property
    def sampling(self) -> SamplingParams:
        """Settings of its own: every field differs from every other caller's."""
        i = self.index
        return SamplingParams(
            audio_temperature=0.25 * i,
            audio_top_k=10 + i,
            text_temperature=1.5 - 0.25 * i,
            text_top_k=20 + i,
            seed=1000 + i,
        )

    def value(self, k: int) -> float:
        """Frame ``k``'s constant: 0.1 per arrival, 0.001 per frame (no two frames of the test alike)."""
        return round(0.1 * (self.index + 1) + 0.001 * k, 6)

    def on_output(self, pcm: np.ndarray | None, piece: str | None) -> None:
        if pcm is not None:
            self.outputs += 1
            mean = echoed_input_mean(pcm, self.tone)
            if abs(mean) > 1e-4:  # a tick without this session's frame echoes silence
                self.heard.append(mean)

    def heard_a_stranger(self) -> bool:
        """An output echoed a frame this session never sent."""
        return any(all(abs(value - sent) >= 1e-4 for sent in self.sent) for value in self.heard)

    def push(self, frames: int) -> None:
        assert self.session is not None
        for _ in range(frames):
            value = self.value(len(self.sent))
            self.sent.append(value)
            self.session.push_frame(np.full(FRAME_SAMPLES, value, dtype=np.float32))


def _whose(value: float, callers: list[_Caller]) -> str:
    for caller in callers:
        for k, sent in enumerate(caller.sent):
            if abs(sent - value) < 1e-4:
                return f"{caller.name}'s frame {k}"
    return "nobody's frame"


async def test_scheduler_gives_each_session_its_own_rows_through_joins_and_leaves() -> None:
    """Four slots, six sessions arriving one after another: A, B, C take slots 0, 1, 2; B leaves and D
    (fourth to arrive) takes slot 1, E slot 3; A leaves and F (sixth) takes slot 0. In every phase each live
    session pushes frames of its own constants (a ramp: every frame of the test differs), and each must hear
    exactly its own frames, in order, less at most its first (its first step is the model's acoustic delay:
    no audio). Each session also has sampling settings of its own, and its slot must join the engine with
    them (A, B and C join in one tick).

    Planted bug: ``SlotScheduler._run`` writes session i's frame into batch row i + 1
    (``pcm_in[(session.slot + 1) % self.slots]``), or hands a session the output of row i + 1
    (``result.pcm[(slot + 1) % self.slots]``) — this test fails on it (a session hears a neighbour's
    frame, or silence where its own echo belongs). Planted bug: ``SlotScheduler._apply_commands`` joins
    every slot with the first joiner's settings — this test fails on it (the recorded joins differ)."""
    loop = asyncio.get_running_loop()
    engine = SimEngine(SLOTS, StepTime(((1, 1.0),)), text_vocab=256, sleep=lambda _: None)
    scheduler = SlotScheduler(engine, _Tokenizer(), RuntimeMetrics(), loop, frame_ms=1.0)  # type: ignore[arg-type]
    joined: list[tuple[int, SamplingParams]] = []
    engine_join = engine.join

    def recording_join(slot: int, sampling: SamplingParams, prompt: list | None = None) -> None:
        joined.append((slot, sampling))
        engine_join(slot, sampling, prompt)

    engine.join = recording_join  # type: ignore[method-assign]
    callers = [_Caller(name, i, engine._tone) for i, name in enumerate("ABCDEF")]
    by_name = {c.name: c for c in callers}
    live: list[_Caller] = []

    def join(name: str) -> int:
        caller = by_name[name]
        caller.session = SlotSession(
            name,
            caller.sampling,
            [],
            caller.on_output,
            lambda: None,
            max_inbox_frames=BATCH_FRAMES + 1,
        )
        caller.push(BATCH_FRAMES)  # queued before the join: the first tick of the slot has its frame
        live.append(caller)
        return scheduler.admit(caller.session)

    async def phase(pushers: list[_Caller]) -> None:
        """The sessions in ``pushers`` push one more batch; wait until every live session has heard every
        frame it sent (its outputs outnumber its frames: silence follows), or one heard a frame it did not
        send (the asserts below say whose)."""
        for caller in pushers:
            caller.push(BATCH_FRAMES)
        goal = {c.name: c.outputs + BATCH_FRAMES + 2 for c in live}
        await wait_until(
            lambda: all(c.outputs >= goal[c.name] for c in live) or any(c.heard_a_stranger() for c in live),
            timeout_s=20,
            what=f"outputs for every frame of {[c.name for c in live]}",
        )

    async def leave(name: str) -> None:
        caller = by_name[name]
        assert caller.session is not None
        free = scheduler.free_slots
        scheduler.release(caller.session)
        live.remove(caller)
        await wait_until(lambda: scheduler.free_slots == free + 1, timeout_s=20, what=f"{name}'s slot")

    slots = {name: join(name) for name in "ABC"}  # queued before the tick starts: they join in one tick
    scheduler.start()
    try:
        await phase([])
        await leave("B")
        slots.update({name: join(name) for name in "DE"})
        await phase([by_name["A"], by_name["C"]])
        await leave("A")
        slots["F"] = join("F")
        await phase([by_name["C"], by_name["D"], by_name["E"]])
    finally:
        scheduler.stop()

    assert slots == {"A": 0, "B": 1, "C": 2, "D": 1, "E": 3, "F": 0}  # slots differ from arrival order
    for caller in callers:
        sent, heard = caller.sent, caller.heard
        dropped = 1 if len(heard) < len(sent) else 0  # the acoustic delay step: the first frame is not echoed
        for k, value in enumerate(heard):
            own = sent[k + dropped] if k + dropped < len(sent) else None
            assert own is not None and abs(value - own) < 1e-4, (
                f"session {caller.name} (slot {slots[caller.name]}) heard {_whose(value, callers)} as its "
                f"output {k} (expected its own frame {k + dropped}: {own})"
            )
    for caller in callers:
        assert len(caller.heard) >= len(caller.sent) - 1, (
            f"session {caller.name} heard {len(caller.heard)} of its {len(caller.sent)} frames echoed"
        )
    # Each slot joined the engine with its own session's settings.
    assert joined == [(slots[c.name], c.sampling) for c in callers]


# --------------------------------------------------------------------------------------------------
# The whole serving path: PCM clients over the wire
# --------------------------------------------------------------------------------------------------

CONSTANTS = {"A": 0.2, "B": -0.3, "C": 0.4, "D": -0.5, "E": 0.6, "F": -0.7}
"""Each client's input level (a constant: the mean of its echo is half of it). Any two are 0.2 or more
apart, and 0.2 or more from silence."""
SETTINGS = {
    name: SamplingParams(
        audio_temperature=0.25 * i,
        audio_top_k=100 + i,
        text_temperature=1.25 - 0.25 * i,
        text_top_k=30 + i,
        seed=500 + i,
    )
    for i, name in enumerate("ABCDEF")
}
"""Each client's sampling settings (its query): every field differs from every other client's."""
HEARD_FRAMES = 6
"""Own echoes every client must hear in its phase."""
TOLERANCE = 0.01
"""How close a frame's echoed mean must be to a level: the tone's mean (twice it is 0.0017) and Int16
rounding (3e-5 a sample) are well inside it; two clients' levels are 0.2 or more apart."""


def _client_means(client: LiveClient) -> list[float]:
    """The echoed input mean of every audio message ``client`` received (Int16 LE PCM)."""
    return [
        echoed_input_mean(np.frombuffer(payload, dtype="<i2").astype(np.float64) / PCM_SCALE)
        for payload in client.audio_payloads
    ]


def _own_echoes(name: str, client: LiveClient) -> int:
    return sum(abs(m - CONSTANTS[name]) < TOLERANCE for m in _client_means(client))


@pytest.mark.slow
@pytest.mark.parametrize("workers", WORKER_MODES)
async def test_each_client_hears_its_own_echo_through_the_server(bundle, workers, monkeypatch) -> None:  # noqa: F811
    """Six PCM clients of a four-slot sim node, each sending a constant level of its own: A, B, C get
    slots 0, 1, 2; B leaves and D (fourth to arrive) gets slot 1, E slot 3; A leaves and F (sixth) gets
    slot 0. Every audio frame a client receives is its own echo (half its level) or silence (a tick its
    frame missed), never another client's, and each hears at least ``HEARD_FRAMES`` of its own; with
    ``--workers 0`` (``LocalSlots``) and ``--workers 2`` (two front ends over ZeroMQ to the engine). Each
    client also asks for sampling settings of its own in its query, and its slot must join the engine with
    exactly those.

    Planted bug: ``SlotScheduler._run`` writes session i's frame into batch row i + 1, or hands a session
    the output of row i + 1 (off-by-one row mapping above the engine) — this test fails on it (a client
    hears a neighbour's level, or only silence). Planted bug: ``SlotScheduler._apply_commands`` joins
    every slot with the first joiner's settings — this test fails on it (the recorded joins differ)."""
    async with running_server(
        bundle, model="sim", sim_step_ms="2", max_sessions=SLOTS, workers=workers
    ) as srv:
        engine = srv.backend.engine
        engine_join = engine.join
        joined: list[tuple[int, SamplingParams]] = []

        def recording_join(slot: int, sampling: SamplingParams, prompt: list | None = None) -> None:
            joined.append((slot, sampling))
            engine_join(slot, sampling, prompt)

        monkeypatch.setattr(engine, "join", recording_join)
        clients: dict[str, LiveClient] = {}
        slots: dict[str, int] = {}

        async def open_client(name: str) -> None:
            before = set(srv.sessions)
            pcm = np.full(4 * FRAME_SAMPLES, CONSTANTS[name], dtype=np.float32)
            settings = SETTINGS[name]
            query = {
                "audio_temperature": settings.audio_temperature,
                "audio_topk": settings.audio_top_k,
                "text_temperature": settings.text_temperature,
                "text_topk": settings.text_top_k,
                "seed": settings.seed,
            }
            client = LiveClient(chat_url(srv, **query), pcm)
            clients[name] = client
            await client.open()
            assert client.result.handshake, f"{name}: {client.result.errors}"
            (session,) = set(srv.sessions) - before
            assert isinstance(session, ChatSession) and session.lease is not None
            slots[name] = session.lease.slot
            client.start_streaming()

        async def hear(names: str) -> None:
            """Until each of ``names`` heard its own echoes, or one heard another's (asserted below)."""
            await wait_until(
                lambda: (
                    all(_own_echoes(n, clients[n]) >= HEARD_FRAMES for n in names)
                    or any(_foreign_echoes(n, clients[n]) for n in names)
                ),
                timeout_s=30,
                what=f"{HEARD_FRAMES} echoes for each of {names}",
            )

        async def leave(name: str) -> None:
            free = srv.backend.status().free_slots
            await clients[name].finish(tail_s=0.0)
            await wait_until(
                lambda: _free_slots(srv) == free + 1, timeout_s=15, what=f"{name}'s slot to be freed"
            )

        try:
            for name in "ABC":
                await open_client(name)
            await hear("ABC")
            await leave("B")
            for name in "DE":
                await open_client(name)
            await hear("DE")
            await leave("A")
            await open_client("F")
            await hear("F")
            for name in "CDEF":
                await clients[name].finish(tail_s=0.0)
        finally:
            for client in clients.values():
                await client.discard()

    assert slots == {"A": 0, "B": 1, "C": 2, "D": 1, "E": 3, "F": 0}  # slots differ from arrival order
    assert joined == [(slots[name], SETTINGS[name]) for name in "ABCDEF"]
    for name, client in clients.items():
        assert client.result.errors == [], f"{name}: {client.result.errors}"
        assert _foreign_echoes(name, client) == [], (
            f"client {name} (slot {slots[name]}, level {CONSTANTS[name]}) heard: "
            f"{_foreign_echoes(name, client)[:5]}"
        )
        assert _own_echoes(name, client) >= HEARD_FRAMES, (
            f"client {name} (slot {slots[name]}) heard {_own_echoes(name, client)} echoes of its own "
            f"level in {len(client.audio_payloads)} frames "
            f"(means {[round(m, 3) for m in _client_means(client)][:8]})"
        )


def _foreign_echoes(name: str, client: LiveClient) -> list[str]:
    """What ``client`` heard that is neither its own echo nor silence, each as "<whose level> (mean)"."""
    found = []
    for mean in _client_means(client):
        if abs(mean - CONSTANTS[name]) < TOLERANCE or abs(mean) < TOLERANCE:
            continue
        owners = [other for other, level in CONSTANTS.items() if abs(mean - level) < TOLERANCE]
        found.append(f"{owners[0] if owners else 'unknown'}'s level ({mean:+.3f})")
    return found


def _free_slots(server: DuplexServer) -> int:
    return server.backend.status().free_slots
