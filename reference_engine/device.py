"""The torch device and KV element type an engine config names, checked before any tensor exists.

`resolve_device` turns `config.device` into a `torch.device`, and refuses, in one line, a CUDA
device that this torch cannot use (built without CUDA, no GPU visible, or an index past the
last GPU) instead of letting the first tensor fail with a long torch error. `kv_dtype` maps
`config.dtype` to the pools' element type. What it does not do: pick a device by itself.
"""

from __future__ import annotations

import torch

from kvcanary.canaries.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`name` ('cpu', 'cuda', 'cuda:N') as a device this process can use, or ConfigError."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {name!r}") from None
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(
            f"device {name!r} requested, but CUDA is not available ({why}; torch "
            f"{torch.__version__}); use device 'cpu'"
        )
    num_gpus = torch.cuda.device_count()
    if device.index is not None and device.index >= num_gpus:
        raise ConfigError(f"device {name!r} requested, but only {num_gpus} GPU(s) are visible")
    return device


def kv_dtype(name: str) -> torch.dtype:
    """The pools' element type for `config.dtype`."""
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]
