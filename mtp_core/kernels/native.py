"""Which native kernels this process can use, decided once, on first use (`native_ops()`).

mtp_core._C (always built when possible) defines the op schemas and the CPU kernels;
mtp_core._C_cuda adds the CUDA kernels for the arch-specific targets it was compiled for
(sm_90a runs only on compute capability 9.0, sm_100a only on 10.0). Anything missing means the
torch reference runs instead; the reason is logged once. The mode (auto | reference) and the CPU instruction
set come from the config's `runtime` section, environment overrides included (mtp_core/config/runtime.py).
"""
from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

import torch

from mtp_core.config import runtime
from mtp_core.kernels.fake import register_fakes

log = logging.getLogger("mtp_core.kernels")
MODES = runtime.KERNEL_MODES


@dataclass(frozen=True)
class NativeOps:
    cpu: bool                        # mtp_core._C loaded: schemas + CPU kernels
    cuda_archs: tuple[str, ...]      # e.g. ("90a", "100a") when mtp_core._C_cuda loaded, else ()
    summary: str                     # one line: what was loaded, or why not

    def cuda_ok(self, device: torch.device) -> bool:
        """True when the CUDA kernels were compiled for this device's compute capability."""
        return bool(self.cuda_archs) and _capability_tag(device.index) in self.cuda_archs


@functools.cache
def _capability_tag(index: int | None) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"{major}{minor}a"


def load_native_ops(mode: str, source: str = "MTP_CORE_KERNELS=reference") -> NativeOps:
    """Import the native extensions unless mode == "reference" (runtime.kernels, env MTP_CORE_KERNELS; source:
    where that was said, for the summary)."""
    if mode not in MODES:
        raise ValueError(f"MTP_CORE_KERNELS={mode!r}: use one of {', '.join(MODES)}")
    if mode == "reference":
        return NativeOps(False, (), f"torch reference kernels ({source})")
    try:
        importlib.import_module("mtp_core._C")
    except ImportError as exc:
        return NativeOps(False, (), f"torch reference kernels (mtp_core._C not available: {exc})")
    register_fakes()
    if not torch.version.cuda:
        return NativeOps(True, (), "native CPU kernels (mtp_core._C); torch has no CUDA")
    try:
        archs = tuple(importlib.import_module("mtp_core._C_cuda").CUDA_ARCHS.split("_"))
    except ImportError as exc:
        return NativeOps(True, (), f"native CPU kernels; CUDA ops use the torch reference "
                                   f"(mtp_core._C_cuda not available: {exc})")
    return NativeOps(True, archs, f"native CPU kernels and CUDA kernels for sm_{', sm_'.join(archs)}")


@functools.cache
def native_ops() -> NativeOps:
    """The native kernels of this process: resolved on the first call (never at import, so importing mtp_core
    has no side effect) from runtime.kernels (auto | reference), logged once, then fixed until an engine is
    configured with another mode. The C++ kernels get their instruction set (runtime.cpu_isa) here."""
    mode = runtime.kernels()
    ops = load_native_ops(mode, runtime.source("kernels"))
    log.info("mtp_core.kernels: %s", ops.summary)
    _resolved_mode[0] = mode
    if ops.cpu:
        _set_cpu_isa()
    return ops


_resolved_mode = [""]     # the mode native_ops() was resolved with


def _set_cpu_isa() -> None:
    import mtp_core._C as _C
    _C.set_cpu_isa(runtime.cpu_isa())


@runtime.when_configured
def _apply_runtime() -> None:
    """An engine was configured: kernels resolved in another mode are resolved again on next use; the C++
    kernels take the configured instruction set. Nothing resolved yet: the first use reads the new settings."""
    if native_ops.cache_info().currsize == 0:
        return
    if runtime.kernels() != _resolved_mode[0]:
        native_ops.cache_clear()
    elif native_ops().cpu:
        _set_cpu_isa()


@functools.cache
def note_fallback(op: str, reason: str) -> None:
    """Log once per (op, reason) that a call fell back to the torch reference."""
    log.info("mtp_core.kernels.%s: torch reference (%s)", op, reason)
