"""kvcanary: tenants."""
