"""One conversation, whatever the transport: its slot, its frames in and out, its transcript, its resume."""
