from typing import Any

def siphash24_into(k0: int, k1: int, message: Any, out: Any, /) -> None:
    """out[i] = SipHash-2-4 of message[i] (1-d C-contiguous uint64 buffers of one length;
    see canaries/_siphash.c)."""
