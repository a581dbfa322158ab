"""What an SDP offer must hold before a slot or a session record is spent on it (issue 34, item 11).

aiortc 1.16 parses leniently and fails late: of 150 fuzzed offers, 10 whose ``a=group:BUNDLE`` named a
``mid`` that no media section had (or left one out) were accepted by ``setRemoteDescription`` and failed in
``createAnswer``, a 500 after a slot was admitted and a session record written; an offer without a DTLS
fingerprint held its slot until the connect timeout (10 s), since DTLS can never verify the peer (RFC 8122,
5: the fingerprint is what authenticates the DTLS handshake). :func:`check_offer` reads those from the
text first, so each is a 400 naming what is wrong, before anything is reserved.

Checked (RFC 8843 BUNDLE, RFC 8122 fingerprints, RFC 8839 ICE attributes; JSEP, RFC 8829, 5.8):

- every media section (``m=``) has an ``a=mid``, and no two share one;
- an ``a=group:BUNDLE`` names only mids of the offer, and each once;
- a DTLS fingerprint (``a=fingerprint:<hash> <hex>``), at session level or in every media section, with a
  hash function WebRTC uses (``sha-256``, ``sha-384``, ``sha-512``; ``sha-1`` is still accepted by aiortc and
  browsers' older offers);
- ICE credentials (``a=ice-ufrag`` and ``a=ice-pwd``), at session level or in every media section.
"""

from __future__ import annotations

__all__ = ["FINGERPRINT_HASHES", "OfferProblem", "check_offer"]

FINGERPRINT_HASHES = frozenset({"sha-1", "sha-256", "sha-384", "sha-512"})
"""The hash functions of ``a=fingerprint`` accepted (RFC 8122, 5; RFC 8827, 6.5: SHA-256 at least)."""


class OfferProblem(ValueError):
    """The offer cannot make a call; the message names what is missing or wrong."""


def _sections(sdp: str) -> tuple[list[str], list[list[str]]]:
    """The session-level lines and each media section's lines (``m=`` first), line endings removed."""
    session: list[str] = []
    media: list[list[str]] = []
    for raw in sdp.splitlines():
        line = raw.strip()
        if line.startswith("m="):
            media.append([line])
        elif media:
            media[-1].append(line)
        else:
            session.append(line)
    return session, media


def _values(lines: list[str], attribute: str) -> list[str]:
    prefix = f"a={attribute}:"
    return [line[len(prefix) :].strip() for line in lines if line.startswith(prefix)]


def check_offer(sdp: str) -> None:
    """Refuse an offer that aiortc would take and then fail on, or that could never connect.

    Raises:
        OfferProblem: a media section without a mid, a duplicate mid, a BUNDLE group naming
            a mid that is not there (or twice), no DTLS fingerprint or one with an unknown hash function, no
            ICE credentials.
    """
    session, media = _sections(sdp)
    if not media:
        return  # nothing to check here: the peer refuses an offer without audio, naming it
    mids: list[str] = []
    for index, section in enumerate(media):
        found = _values(section, "mid")
        if len(found) != 1 or not found[0]:
            raise OfferProblem(f"media section {index} ({section[0][:40]}) has no a=mid (or several)")
        mids.append(found[0])
    if len(set(mids)) != len(mids):
        raise OfferProblem(f"two media sections share a mid: {mids}")
    for group in _values(session, "group"):
        semantics, *named = group.split()
        if semantics != "BUNDLE":
            continue
        unknown = [mid for mid in named if mid not in mids]
        if unknown or len(set(named)) != len(named):
            raise OfferProblem(
                f"a=group:BUNDLE names {named}, but the offer's media sections are {mids}: each BUNDLE "
                "mid must be one of them, once"
            )
    session_fingerprints = _values(session, "fingerprint")
    for index, section in enumerate(media):
        fingerprints = _values(section, "fingerprint") or session_fingerprints
        if not fingerprints:
            raise OfferProblem(
                f"media section {index} has no DTLS fingerprint (a=fingerprint:sha-256 <hex>): DTLS "
                "could never authenticate the caller"
            )
        for fingerprint in fingerprints:
            algorithm = fingerprint.split()[0].lower() if fingerprint.split() else ""
            if algorithm not in FINGERPRINT_HASHES:
                raise OfferProblem(
                    f"a=fingerprint hash {algorithm!r} is not one of {', '.join(sorted(FINGERPRINT_HASHES))}"
                )
        for attribute in ("ice-ufrag", "ice-pwd"):
            if not (_values(section, attribute) or _values(session, attribute)):
                raise OfferProblem(f"media section {index} has no a={attribute} (ICE credentials)")
