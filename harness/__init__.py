"""kvcanary: harness."""
