"""kvcanary: canaries."""
