"""The resume credential out of the URL (issue 34, item 1: ``?resume=`` is kept by proxies' and load
balancers' logs): a resume presents it in the ``Duplex-Resume-Credential`` header, or, from a browser, as the
WebSocket subprotocol ``duplex.resume.<credential>``, which the server selects (RFC 6455, 4.2.2); the
deprecated ``?resume=`` still works; two places giving different credentials are refused ``bad_request``
naming both. The project's own clients (the page, the resume bench, the node check) no longer put it in the
URL.

Real servers on loopback (``tests/test_server_e2e.py``'s :func:`running_server`, ``--workers 0``), the tiny
model, real speech; a drop is the client's TCP connection aborted (no close frame). Waits are for events.
WebRTC's header resume: ``tests/test_rtc_resume.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_resume import detached, open_resumable, session_of
from test_server_e2e import (  # noqa: F401 (bundle, speech: fixtures)
    AFTER_FRAMES,
    WAIT_S,
    LiveClient,
    bundle,
    chat_url,
    local_metrics,
    running_server,
    speech,
    wait_until,
)

from runtime.engine.resume import credential_session
from runtime.frontend.codecs.protocol import ProtocolError
from runtime.frontend.gate.query import RESUME_HEADER, RESUME_SUBPROTOCOL_PREFIX, ResumePresented

WEB = Path(__file__).resolve().parents[1] / "infra" / "node" / "web"
SID = "0123456789abcdef0123456789abcdef"
ONE = f"{SID}.{'A' * 43}"
OTHER = f"{SID}.{'B' * 43}"


# --------------------------------------------------------------------------------------------------
# Where a credential may come from
# --------------------------------------------------------------------------------------------------


def test_a_credential_fits_a_header_and_a_subprotocol_token() -> None:
    """RFC 7230's ``tchar`` (RFC 6455, 4.1: a subprotocol is a token): a credential's every character is one
    (32 hex digits, '.', 43 base64url characters: runtime.engine.resume)."""
    tchar = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
    assert credential_session(ONE) is not None
    assert tchar.fullmatch(RESUME_SUBPROTOCOL_PREFIX + ONE) and tchar.fullmatch(RESUME_HEADER)


@pytest.mark.parametrize(
    ("presented", "credential", "subprotocol"),
    [
        (ResumePresented.of(None, [ONE]), ONE, None),
        (ResumePresented.of(None, [], [f"duplex.token.x, {RESUME_SUBPROTOCOL_PREFIX}{ONE}"]), ONE, None),
        (ResumePresented.of(ONE, []), ONE, None),
        (ResumePresented.of(ONE, [f" {ONE} ", ONE], [RESUME_SUBPROTOCOL_PREFIX + ONE]), ONE, None),
        (ResumePresented.of(None, ["  "], ["duplex.token.x"]), None, None),
    ],
)
def test_one_credential_is_taken_from_any_place(
    presented: ResumePresented, credential: str | None, subprotocol: None
) -> None:
    assert presented.credential() == credential
    assert presented.given is (credential is not None)
    assert presented.subprotocol == (RESUME_SUBPROTOCOL_PREFIX + ONE if presented.subprotocols else None), (
        "the offered resume subprotocol is the one to select"
    )


@pytest.mark.parametrize(
    ("presented", "words"),
    [
        (
            ResumePresented.of(ONE, [OTHER]),
            "the query parameter resume (deprecated) and the Duplex-Resume-Credential header give different",
        ),
        (
            ResumePresented.of(None, [ONE], [RESUME_SUBPROTOCOL_PREFIX + OTHER]),
            "the Duplex-Resume-Credential header and the Sec-WebSocket-Protocol duplex.resume.<credential>",
        ),
        (ResumePresented.of(None, [ONE, OTHER]), "the Duplex-Resume-Credential header gives 2 different"),
        (
            ResumePresented.of(
                None, [], [f"{RESUME_SUBPROTOCOL_PREFIX}{ONE}, {RESUME_SUBPROTOCOL_PREFIX}{OTHER}"]
            ),
            "duplex.resume.<credential> gives 2 different",
        ),
        (
            ResumePresented.of(None, [f"{ONE}/x"]),
            "the Duplex-Resume-Credential header is not a resume credential",
        ),
        (
            ResumePresented.of(None, [], [RESUME_SUBPROTOCOL_PREFIX]),
            "duplex.resume.<credential> is not a resume",
        ),
    ],
)
def test_conflicting_or_malformed_credentials_are_refused_naming_the_places(
    presented: ResumePresented, words: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        presented.credential()
    assert words in str(caught.value), str(caught.value)
    assert ONE not in str(caught.value) and OTHER not in str(caught.value), "a credential echoed (and logged)"


# --------------------------------------------------------------------------------------------------
# Over the WebSocket
# --------------------------------------------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="module")
async def test_a_websocket_resumes_by_header_then_by_subprotocol_and_conflicts_are_refused(
    bundle,  # noqa: F811
    speech,  # noqa: F811
):
    """A dropped session resumed with ``Duplex-Resume-Credential`` (nothing in the URL); dropped again,
    resumed as a browser does, the credential offered as the subprotocol, which the server selects; a third
    drop: a header and a subprotocol giving different credentials are refused ``bad_request`` (1008, both
    places named), and the held session is untouched: the right credential still resumes it."""
    async with running_server(bundle, workers=0) as srv:
        a, meta = await open_resumable(srv, speech[0], resumable=1)
        legs = [a]
        try:
            session_id, credential = meta["session_id"], meta["resume"]
            await a.wait_audio(AFTER_FRAMES)
            a.abort()
            await detached(srv, 1)

            by_header = LiveClient(
                chat_url(srv, format="pcm"), speech[0], headers={RESUME_HEADER: credential}
            )
            legs.append(by_header)
            assert "resume" not in by_header.url
            await by_header.open()
            assert by_header.result.handshake, (by_header.result.errors, by_header.result.close_code)
            await wait_until(lambda: bool(by_header.metadata), timeout_s=WAIT_S, what="the resumed metadata")
            again = by_header.metadata[0]
            assert again["session_id"] == session_id and again["resumed"] is True, again
            by_header.start_streaming()
            await by_header.wait_audio(AFTER_FRAMES)
            by_header.abort()
            await detached(srv, 2)

            offered = RESUME_SUBPROTOCOL_PREFIX + again["resume"]
            by_protocol = LiveClient(chat_url(srv, format="pcm"), speech[0], subprotocols=[offered])
            legs.append(by_protocol)
            await by_protocol.open()
            assert by_protocol.result.handshake, (by_protocol.result.errors, by_protocol.result.close_code)
            assert by_protocol.ws is not None and by_protocol.ws.subprotocol == offered, "not selected"
            await wait_until(
                lambda: bool(by_protocol.metadata), timeout_s=WAIT_S, what="the resumed metadata"
            )
            third = by_protocol.metadata[0]
            assert third["session_id"] == session_id and third["resumed"] is True, third
            by_protocol.start_streaming()
            await by_protocol.wait_audio(AFTER_FRAMES)
            by_protocol.abort()
            await detached(srv, 3)

            sid, secret = credential_session(third["resume"]) or ("", "")
            forged = f"{sid}.{secret[::-1]}"
            clash = LiveClient(
                chat_url(srv, format="pcm"),
                speech[0],
                headers={RESUME_HEADER: third["resume"]},
                subprotocols=[RESUME_SUBPROTOCOL_PREFIX + forged],
            )
            legs.append(clash)
            await clash.open()
            await clash.wait_closed()
            assert not clash.result.handshake and clash.result.close_code == 1008, clash.result.close_code
            error = clash.result.errors[0]
            assert "Duplex-Resume-Credential header" in error and "duplex.resume.<credential>" in error, error
            assert clash.ws is not None and clash.ws.subprotocol == RESUME_SUBPROTOCOL_PREFIX + forged
            assert local_metrics(srv).value("duplex_resume_refused_total", reason="bad_request") == 1

            last = LiveClient(
                chat_url(srv, format="pcm"), speech[0], headers={RESUME_HEADER: third["resume"]}
            )
            legs.append(last)
            await last.open()
            assert last.result.handshake, last.result.errors
            await wait_until(lambda: bool(last.metadata), timeout_s=WAIT_S, what="the resumed metadata")
            assert last.metadata[0]["session_id"] == session_id and last.metadata[0]["resumed"] is True
            assert session_of(srv, session_id) is not None
            last.start_streaming()
            await last.wait_audio(AFTER_FRAMES)
            result = await last.finish(tail_s=0.3)
            assert result.close_code == 1000 and result.errors == [], (result.close_code, result.errors)
        finally:
            for leg in legs:
                await leg.discard()
        assert local_metrics(srv).value("duplex_sessions_resumed_total") == 3


# --------------------------------------------------------------------------------------------------
# The project's clients
# --------------------------------------------------------------------------------------------------


def test_the_page_and_the_tools_put_no_credential_in_a_url() -> None:
    """The page resumes a WebSocket with the ``duplex.resume.`` subprotocol and a WebRTC call with the
    header; the resume bench, the WebRTC bench and the node check send the header: none builds
    ``resume=`` into a URL. The page's constants are the runtime's."""
    root = WEB.parents[2]
    sources = {
        path: (root / path).read_text()
        for path in (
            "infra/node/web/app.js",
            "infra/node/web/rtc.js",
            "runtime/tools/resume_bench.py",
            "runtime/tools/resume_bench_rtc.py",
            "runtime/tools/rtc_client.py",
            "infra/node/local/resume_check.py",
        )
    }
    for path, text in sources.items():
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("//", "#")))
        built = re.search(r"[?&\"'`]resume=|session_url\([^)]*resume=", code)
        assert built is None, f"{path} puts resume= in a URL: {built}"
    protocol = (WEB / "protocol.js").read_text()
    assert f'RESUME_SUBPROTOCOL_PREFIX = "{RESUME_SUBPROTOCOL_PREFIX}"' in protocol
    assert f'RESUME_HEADER = "{RESUME_HEADER}"' in protocol
    assert "[RESUME_SUBPROTOCOL_PREFIX + s.resume]" in sources["infra/node/web/app.js"]
    assert "[RESUME_HEADER]: resume" in sources["infra/node/web/rtc.js"]
