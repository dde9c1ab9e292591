"""kvcanary subcommands: one module per command, each exposing `register(subparsers)`."""
