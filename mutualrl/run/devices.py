"""Devices: parsing ``auto | cpu | cuda | cuda:N``, what they support, and which one a policy gets."""

from __future__ import annotations

import re

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def cuda_count() -> int:
    """Visible CUDA devices (0 without CUDA or without a CUDA build of torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(spec: str) -> str | None:
    """An error message if ``spec`` is not a device this machine has, else None."""
    if not _DEVICE.match(spec or ""):
        return f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {spec!r}"
    if spec.startswith("cuda"):
        n = cuda_count()
        if n == 0:
            return (f"{spec!r} asked for, but CUDA is not available here (torch "
                    f"{_torch_version()} sees no GPU); use device: cpu or auto")
        if ":" in spec and int(spec.split(":")[1]) >= n:
            return f"{spec!r} asked for, but this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})"
    return None


def _torch_version() -> str:
    import torch

    return torch.__version__


def cuda_supports_bf16(spec: str = "cuda") -> bool:
    """Whether the CUDA device ``spec`` computes in bfloat16 natively (compute capability >= 8.0)."""
    import torch

    if cuda_count() == 0:
        return False
    idx = int(spec.split(":")[1]) if ":" in spec else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx) >= (8, 0)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (Linux ``/proc/cpuinfo``; True if unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return True


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on a CUDA device that supports it, float32 elsewhere; else ``dtype``."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") and cuda_supports_bf16(device) else "float32"
