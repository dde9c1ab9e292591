"""Talking to a target: the HTTP client and SSE stream, server facts, limits discovery,
the target's tokenizer, and the pool/context audit."""
