"""An SDP offer's transport lines checked before any slot or session record (issue 34, item 11).

aiortc (1.16) accepts offers it cannot answer: a BUNDLE group that names a ``mid`` no m-line has (or leaves
one out) fails in ``createAnswer``, after the session was admitted and its record written (a 500); an offer
without ``a=fingerprint`` is answered and then holds its slot until the connect timeout, since DTLS can
never verify the peer. :func:`check_offer` refuses them first, naming what is wrong:

- every m-line has one ``a=mid``, distinct from the others' (RFC 8843 section 9.2; RFC 5888);
- one ``a=group:BUNDLE`` naming exactly the m-lines' mids (the answer bundles every m-line on one
  transport: RFC 8843 section 7.3.1; browsers offer ``max-bundle``'s single group);
- ``a=fingerprint`` at the session level or in every m-line, each with a hash aiortc verifies
  (:data:`FINGERPRINT_HASHES`; RFC 8122 section 5);
- ``a=ice-ufrag`` and ``a=ice-pwd`` at the session level or in every m-line, of RFC 8839 section 5.4's
  ``ice-char`` set and lengths (ufrag 4-256, pwd 22-256).

Pure: text in, :class:`OfferInvalid` out.
"""

from __future__ import annotations

import re

__all__ = ["FINGERPRINT_HASHES", "OfferInvalid", "check_offer"]

FINGERPRINT_HASHES = frozenset({"sha-256", "sha-384", "sha-512"})
"""Hash functions of ``a=fingerprint`` the node can verify: aiortc 1.16 ``rtcdtlstransport.py``
``X509_DIGEST_ALGORITHMS``."""

_ICE_CHARS = re.compile(r"[A-Za-z0-9+/]+")
"""RFC 8839 section 5.4: ``ice-char = ALPHA / DIGIT / "+" / "/"``."""
_UFRAG_LENGTHS = (4, 256)
_PWD_LENGTHS = (22, 256)


class OfferInvalid(ValueError):
    """The offer's transport lines cannot make a connection: the message says which line and what is
    allowed (a 400 before any slot is taken)."""


def _attributes(lines: list[str], name: str) -> list[str]:
    prefix = f"a={name}:"
    return [line[len(prefix) :].strip() for line in lines if line.startswith(prefix)]


def _sections(sdp: str) -> tuple[list[str], list[list[str]]]:
    """The session-level lines and each m-line's lines (its ``m=`` line first)."""
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


def _check_fingerprints(values: list[str], where: str) -> None:
    for value in values:
        parts = value.split()
        if len(parts) != 2 or not re.fullmatch(r"[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2})+", parts[1]):
            raise OfferInvalid(
                f"{where}: a=fingerprint:{value[:80]} is not '<hash> <hex bytes separated by :>'"
            )
        if parts[0].lower() not in FINGERPRINT_HASHES:
            raise OfferInvalid(
                f"{where}: a=fingerprint uses {parts[0]!r}; "
                f"use one of {', '.join(sorted(FINGERPRINT_HASHES))}"
            )


def _check_ice(ufrags: list[str], pwds: list[str], where: str) -> None:
    for name, values, (low, high) in (
        ("ice-ufrag", ufrags, _UFRAG_LENGTHS),
        ("ice-pwd", pwds, _PWD_LENGTHS),
    ):
        if len(values) != 1:
            raise OfferInvalid(f"{where}: {len(values)} a={name} lines; give exactly one")
        value = values[0]
        if not _ICE_CHARS.fullmatch(value) or not low <= len(value) <= high:
            raise OfferInvalid(
                f"{where}: a={name} must be {low}-{high} characters of letters, digits, '+' and '/' "
                f"(RFC 8839), got {len(value)}"
            )


def check_offer(sdp: str) -> None:
    """Check ``sdp``'s mids, BUNDLE group, DTLS fingerprints and ICE credentials (the module docstring).

    Raises:
        OfferInvalid: the first thing wrong, named.
    """
    session, media = _sections(sdp)
    if not media:
        raise OfferInvalid("the SDP offer has no m-line: offer one audio m-line (and a DataChannel)")
    mids: list[str] = []
    for index, section in enumerate(media):
        found = _attributes(section, "mid")
        if len(found) != 1 or not found[0]:
            raise OfferInvalid(f"m-line {index} ({section[0][:40]}) has {len(found)} a=mid lines; give one")
        if found[0] in mids:
            raise OfferInvalid(f"m-lines share a=mid:{found[0][:64]}; each m-line needs its own mid")
        mids.append(found[0])
    groups = [value.split() for value in _attributes(session, "group") if value.split()[:1] == ["BUNDLE"]]
    if len(groups) != 1:
        raise OfferInvalid(
            f"the SDP offer has {len(groups)} a=group:BUNDLE lines; give one naming every m-line's mid "
            f"({' '.join(mids)[:120]})"
        )
    bundled = groups[0][1:]
    if sorted(bundled) != sorted(mids):
        raise OfferInvalid(
            f"a=group:BUNDLE names {' '.join(bundled)[:120] or 'no mid'} but the m-lines' mids are "
            f"{' '.join(mids)[:120]}: it must name each m-line's mid once"
        )
    session_fingerprints = _attributes(session, "fingerprint")
    _check_fingerprints(session_fingerprints, "session level")
    session_ufrags, session_pwds = _attributes(session, "ice-ufrag"), _attributes(session, "ice-pwd")
    for index, section in enumerate(media):
        where = f"m-line {index} (mid {mids[index][:64]})"
        fingerprints = _attributes(section, "fingerprint")
        _check_fingerprints(fingerprints, where)
        if not fingerprints and not session_fingerprints:
            raise OfferInvalid(
                f"{where} has no a=fingerprint (nor has the session level): DTLS needs the certificate's "
                f"fingerprint ({', '.join(sorted(FINGERPRINT_HASHES))})"
            )
        ufrags = _attributes(section, "ice-ufrag") or session_ufrags
        pwds = _attributes(section, "ice-pwd") or session_pwds
        _check_ice(ufrags, pwds, where)
