"""The persona prompt's limits, stated once: the engine runs them (one LM step per token) and the front
end's query parser, admission check and ``/api/personas`` quote them (docs/protocol.md, "Wire protocol")."""

from __future__ import annotations

import re

__all__ = [
    "PersonaError",
    "TEXT_PROMPT_LIMIT",
    "TEXT_PROMPT_MAX_CHARS",
    "TEXT_PROMPT_MAX_TOKENS",
    "VOICE_PROMPT_MAX_CHARS",
    "VOICE_PROMPT_RE",
    "voice_name",
]

VOICE_PROMPT_MAX_CHARS = 64
TEXT_PROMPT_MAX_TOKENS = 1000
"""The text prompt's limit in tokens of the model's tokenizer, the ``<system> ... <system>`` wrapper
included: one LM step each (``runtime.engine.persona.build_prompt``), and well inside the 7B's 3000-step
context."""
TEXT_PROMPT_MAX_CHARS = 4000
"""The text prompt's limit in characters: about 1000 tokens of English with Kyutai's 32k tokenizer (about
4 characters a token); a bound on what a client may send, checked before anything is tokenised."""
TEXT_PROMPT_LIMIT = (
    f"at most {TEXT_PROMPT_MAX_CHARS} characters and at most {TEXT_PROMPT_MAX_TOKENS} tokens of the model's "
    "tokenizer (the <system> wrapper included)"
)
"""The one statement of the text prompt's limit: the query parser checks the characters, session planning
(the ``/api/chat`` upgrade and ``/api/admission`` alike) the tokens, and both refuse with this sentence;
``/api/personas`` and docs/protocol.md give the same two numbers."""

VOICE_PROMPT_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.\-]{{0,{VOICE_PROMPT_MAX_CHARS - 1}}}")
"""A voice prompt's name: a preset of the voice catalog, never a path."""


def voice_name(voice_prompt: str) -> str:
    """The catalog name ``voice_prompt`` asks for: NVIDIA's file name ``NATF2.pt`` (as its server and
    LiveKit's PersonaPlex plugin send ``voice_prompt``) names the voice ``NATF2``; any other name is
    itself."""
    return voice_prompt.removesuffix(".pt")


class PersonaError(ValueError):
    """A persona the node cannot serve (unknown voice, prompt too long); the message says what is allowed."""
