"""The prefix-cache timing probe: its design (paired arms), the probe loop and its statistics."""
