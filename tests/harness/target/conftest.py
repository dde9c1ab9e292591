"""The client backends every TCP test of the target client runs on: both must pass the same
suite (`harness.target.http_client.BACKENDS`)."""

from __future__ import annotations

import pytest

from kvcanary.harness.target.http_client import BACKENDS, Backend


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Which library does the TCP I/O under the httpx API."""
    backend: Backend = request.param
    return backend
