"""kvcanary: reports."""
