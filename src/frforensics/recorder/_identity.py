"""The rank's physical identity, written into every dump: what an orchestrator excludes.

``local_rank`` comes from ``LOCAL_RANK`` (torchrun, Slurm wrappers); the CUDA
device is the one this rank's recorded ops ran on (``cuda:N`` of its newest
CUDA entry), else ``torch.cuda.current_device()`` when CUDA is already
initialized in this process. CUDA is never initialized here: a CPU-only job
(or one that has not touched CUDA) records ``None``. The GPU UUID and PCI bus id
come from ``torch.cuda.get_device_properties``: the PCI address is formatted as
PyTorch itself formats it for sysfs (``torch/numa/binding.py``,
``f"{domain:04x}:{bus:02x}:{device:02x}.0"``), the UUID with nvidia-smi's
``GPU-`` prefix.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["Identity", "local_identity"]


@dataclass(frozen=True, slots=True)
class Identity:
    """Where a rank runs, beyond its host name (``None``: unknown or CPU)."""

    local_rank: int | None = None
    cuda_device: int | None = None
    gpu_uuid: str | None = None
    pci_bus_id: str | None = None


_CACHE: dict[int, tuple[str | None, str | None]] = {}


def _device_from_entries(devices: list[str]) -> int | None:
    for dev in reversed(devices):
        if dev.startswith("cuda:"):
            with contextlib.suppress(ValueError):
                return int(dev[5:])
    return None


def _gpu_of(index: int) -> tuple[str | None, str | None]:
    hit = _CACHE.get(index)
    if hit is not None:
        return hit
    uuid = pci = None
    with contextlib.suppress(Exception):
        import torch as _torch

        torch: Any = _torch
        props = torch.cuda.get_device_properties(index)
        raw = getattr(props, "uuid", None)
        if raw is not None:
            text = str(raw)
            uuid = text if text.startswith("GPU-") else f"GPU-{text}"
        domain = getattr(props, "pci_domain_id", None)
        bus = getattr(props, "pci_bus_id", None)
        dev = getattr(props, "pci_device_id", None)
        if isinstance(domain, int) and isinstance(bus, int) and isinstance(dev, int):
            pci = f"{domain:04x}:{bus:02x}:{dev:02x}.0"
    _CACHE[index] = (uuid, pci)
    return uuid, pci


def local_identity(entry_devices: list[str]) -> Identity:
    """This process's identity; ``entry_devices`` are the recorded ``cuda:N`` strings.

    Never raises and never initializes CUDA.
    """
    local_rank = None
    raw = os.environ.get("LOCAL_RANK", "")
    if raw.strip().isdigit():
        local_rank = int(raw)
    device = _device_from_entries(entry_devices)
    if device is None:
        with contextlib.suppress(Exception):
            import torch as _torch

            torch: Any = _torch
            if torch.cuda.is_initialized():
                device = int(torch.cuda.current_device())
    if device is None:
        return Identity(local_rank=local_rank)
    uuid, pci = _gpu_of(device)
    return Identity(local_rank=local_rank, cuda_device=device, gpu_uuid=uuid, pci_bus_id=pci)
