"""What a node keeps of its conversations: the Redis registry and transcripts (written off the audio path),
the events stream, the sessions API's reads and erasure, and consented recordings on disk."""
