"""The runtime's configuration: one typed object, read from ``DUPLEX_*`` environment variables and the CLI.

Every field is validated when the process starts; a bad value stops it with the variable's name, the
value and what is allowed, before any model is loaded.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime.model_presets import PRESETS


class RuntimeConfig(BaseSettings):
    """Settings of one runtime process (one node's model copy and its slots).

    Environment: each field as ``DUPLEX_<FIELD>`` (e.g. ``DUPLEX_MAX_SESSIONS=5``). The Hugging Face
    token is never a field: ``huggingface_hub`` reads ``HF_TOKEN`` itself at load time.
    """

    model_config = SettingsConfigDict(env_prefix="DUPLEX_", extra="forbid")

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 inside a container)")
    port: int = Field(8998, ge=0, le=65535, description="WebSocket/HTTP port; 0 picks a free one")
    model: str = Field("tiny", description="Model preset: " + ", ".join(sorted(PRESETS)))
    weights: str | None = Field(None, description="Checkpoint directory or HF repo id; default the preset's")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1 ...")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="LM weight dtype; default float32 on a CPU, bfloat16 on a GPU (use float16 on a T4)"
    )
    seed: int = Field(0, ge=0, description="Seed of the tiny preset's random weights")
    max_sessions: int = Field(5, ge=1, le=256, description="Batch slots B = concurrent sessions")
    node_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=128)
    redis_url: str | None = Field(
        None, description="redis://[:password@]host:port/db; None disables the store"
    )
    transcript_ttl_s: int = Field(
        86400,
        ge=60,
        description="Redis TTL (s) of a session's record and transcript, refreshed at each write",
    )
    voices_dir: Path | None = Field(None, description="Directory of voice prompts (*.wav, *.pt)")
    drain_grace_s: float = Field(30.0, ge=0, description="After SIGTERM, how long running sessions may go on")
    max_session_s: float = Field(3600.0, gt=0, description="Longest session; it is closed after this")
    max_message_bytes: int = Field(65536, ge=1024, description="Largest client WebSocket message")
    max_inbox_frames: int = Field(8, ge=1, description="Input frames buffered per session (8 = 640 ms)")
    max_outbox_frames: int = Field(
        25, ge=1, description="Output frames queued per session before drops (2 s)"
    )
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads; default torch's")

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown model {value!r}; allowed: {', '.join(sorted(PRESETS))}")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind = value.split(":", 1)[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
        return value
