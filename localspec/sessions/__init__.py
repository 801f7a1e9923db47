"""User sessions: a loaded pair (session), and the chat, bench and versus libraries over it."""
