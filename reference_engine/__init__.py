"""kvcanary: reference_engine."""
