"""Shared test helpers for `tests/harness/*`: this folder's helper modules (recorded and
misbehaving targets) are importable by name from its subfolders, because pytest puts a
conftest's folder on `sys.path` before it collects the folders below it."""
