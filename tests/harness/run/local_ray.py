"""A local Ray instance for a test module or a benchmark: 2 CPUs, bound to 127.0.0.1, a
small object store, its own short temp dir (Ray's socket paths under it must fit in 107
bytes), removed at the end."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def local_ray() -> Iterator[Path]:
    """Ray started for the block (its temp dir yielded), shut down after it."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    ray.init(
        num_cpus=2,
        object_store_memory=80 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
    )
    try:
        yield Path(temp_dir)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
