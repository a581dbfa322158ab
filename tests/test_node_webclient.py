"""The browser client's files (``infra.node.bundle.webclient``): what the bundle carries, that they ship with
the package, that they fetch nothing from elsewhere, and that the page has plain words for every reason the
runtime can give. The page itself runs in a real browser in ``test_browser_client``."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from infra.node.bundle.render import render_bundle
from infra.node.bundle.webclient import WEB_DIR, WEB_TYPES, render_web
from infra.node.profile.profiles import PROFILES
from runtime.frontend.server import ADMISSION_REASONS

SOURCE = Path(__file__).resolve().parents[1] / "infra" / "node" / "web"
REPO = SOURCE.parents[2]


def test_render_web_is_every_shipped_file_byte_for_byte() -> None:
    files = render_web()
    on_disk = {f"{WEB_DIR}/{p.name}": p.read_bytes() for p in SOURCE.iterdir() if p.suffix[1:] in WEB_TYPES}
    assert files == on_disk and list(files) == sorted(files)
    expected = {"index.html", "style.css", "app.js", "protocol.js", "player.js", "audio-worklet.js"}
    assert expected <= {path.removeprefix(f"{WEB_DIR}/") for path in files}
    assert render_web() == files  # the same bytes every time


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_node_bundle_carries_the_client(name: str) -> None:
    bundle = render_bundle(PROFILES[name])
    assert {path: bundle[path] for path in render_web()} == render_web()


def test_the_package_ships_the_files() -> None:
    """pyproject.toml's package-data for ``infra.node`` matches every file of the page (a wheel or a
    non-editable install would otherwise serve a page with missing files)."""
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["infra.node"]
    for path in SOURCE.iterdir():
        relative = path.relative_to(REPO / "infra" / "node").as_posix()
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), f"{relative} is not package data"


def test_nothing_is_fetched_from_elsewhere() -> None:
    """No CDN, no absolute URL: every script, style, icon and module import is one of the shipped files."""
    files = render_web()
    names = {path.removeprefix(f"{WEB_DIR}/") for path in files}
    for path, content in files.items():
        text = re.sub(r'xmlns="[^"]*"', "", content.decode("utf-8"))  # a namespace name, never fetched
        assert not re.search(r"(?i)\b(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text), f"{path} names a host"
        if path.endswith(".js"):
            for target in re.findall(r'from\s+"\./([^"]+)"', text) + re.findall(r'URL\("([^"]+)"', text):
                assert target in names, f"{path} imports {target}, which is not shipped"
    index = files[f"{WEB_DIR}/index.html"].decode()
    references = re.findall(r'(?:src|href)="([^"]+)"', index)
    assert references and all(ref in names for ref in references), references
    assert "<script>" not in index and "style=" not in index  # the CSP allows neither inline script nor style


def _js_table_keys(text: str, name: str) -> set[str]:
    body = text[text.index(f"export const {name} = Object.freeze({{") :]
    body = body[: body.index("});")]
    return set(re.findall(r"^\s+([a-z_]+):", body, flags=re.MULTILINE))


def test_every_refusal_reason_has_plain_words() -> None:
    protocol = (SOURCE / "protocol.js").read_text()
    words = _js_table_keys(protocol, "REASONS")
    missing = set(ADMISSION_REASONS) - {"ok"} - words
    assert not missing, f"protocol.js REASONS has no words for {sorted(missing)}"
    # ...and for what nginx answers by itself, and what the page maps close codes and 0x05 messages to.
    derived = set(re.findall(r'(?:return|\?\?) "([a-z_]+)"', protocol))
    derived |= set(re.findall(r'\d{3}: "([a-z_]+)"', protocol))
    assert derived and derived <= words, sorted(derived - words)
    app = (SOURCE / "app.js").read_text()
    used = set(re.findall(r'(?:end\(s, |showProblem\()"([a-z_]+)"', app))
    used |= set(re.findall(r'"([a-z]+(?:_[a-z]+)+)"', app))  # every snake_case literal is a reason code
    assert used and used <= words, sorted(used - words)


def test_node_up_prints_the_page_and_a_one_conversation_link(tmp_path: Path) -> None:
    """``duplex node up --keep-running`` prints the page, a link carrying a fresh token in its fragment
    (kept out of server logs) and how to mint more; the token opens sessions on that node."""
    from rich.console import Console

    from infra.node import cli
    from infra.node.bundle.services import token_audience
    from infra.node.local.node import LocalNode, free_port_profile
    from runtime.frontend.gate.tokens import TokenVerifier

    node = LocalNode(tmp_path / "node", free_port_profile())
    recorded = Console(record=True, width=4000)
    original, cli.console = cli.console, recorded
    try:
        cli._print_browser_client(node)
    finally:
        cli.console = original
    text = recorded.export_text()
    page = f"https://localhost:{node.profile.ports.https}/"
    assert f"browser client: {page} " in text
    link = re.search(re.escape(page) + r"#token=(\S+)", text)
    assert link, text
    claims = TokenVerifier(node.secrets.signing_keys(), token_audience(node.profile)).verify(link.group(1))
    assert 14 * 60 < claims.expires_at - claims.issued_at <= 15 * 60 and claims.personas == ("*",)
    assert (
        f"duplex token mint --key-file {node.node_dir}/secrets/token_keys.json --audience localhost" in text
    )
