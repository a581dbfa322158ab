"""Wire formats at the edge: Kyutai's message protocol (``codecs.protocol``), its audio payloads (Ogg/Opus
and PCM, ``codecs.kyutai_audio``) and raw Opus packets for RTP (``codecs.opus_rtp``). Pure: no socket."""
