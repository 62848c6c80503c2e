"""The runtime switches, resolved: the one module that reads the project's environment variables.

The config's `runtime` section (engine.py: RuntimeConfig, YAML `runtime:`) declares them; each has an
environment variable that overrides it where it is set (an empty value counts as unset):

  runtime.kernels        MTP_CORE_KERNELS        auto | reference
  runtime.cpu_isa        MTP_CORE_CPU_ISA        auto | amx | avx512 | avx512f | avx2 | generic
  runtime.native_decode  MTP_CORE_NATIVE_DECODE  1 | 0 (or true / false)
  runtime.native_layout  MTP_CORE_NATIVE_LAYOUT  auto | direct | packed
  runtime.device         MTP_CORE_DEVICE         auto | cpu | cuda | cuda:N (the CLI's device)
  LLMConfig.native_step  MTP_CORE_NATIVE_STEP    0 turns the native step off (a Python API field, no YAML key)
  (torchrun runs)        MTP_DIST_TIMEOUT_S      seconds before a collective gives up (default 1800)

`configure(runtime)` records the settings of the engine being built: `LLM` calls it first, before the model
loads, and the process-wide choices follow it (kernels/native.py re-resolves the kernels table when their mode
changed and hands the C++ kernels their instruction set). Until an engine is configured the defaults hold, so
code that builds models or calls ops without an `LLM` behaves as it always did.

The getters read the environment when a setting is asked for (while a model or an engine is built, never per
step), so a variable a test sets takes effect on the next model it builds. A bad value is a ConfigError (a
ValueError) of one line naming the variable and the accepted values; a bad YAML value is refused by the YAML
loader with the key's path. The build switches MTP_CORE_BUILD_EXT and MTP_CORE_CUDA_ARCHS belong to setup.py.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Callable, Optional

from .engine import CPU_ISAS, KERNEL_MODES, NATIVE_LAYOUTS, RuntimeConfig
from .schema import ConfigError, entries

__all__ = ["CPU_ISAS", "ENV", "KERNEL_MODES", "NATIVE_LAYOUTS", "NATIVE_STEP_ENV", "RuntimeConfig", "configure",
           "cpu_isa", "device", "dist_timeout_s", "kernels", "native_decode", "native_layout", "native_step", "setting", "source",
           "when_configured"]

ENV = {"kernels": "MTP_CORE_KERNELS", "cpu_isa": "MTP_CORE_CPU_ISA", "native_decode": "MTP_CORE_NATIVE_DECODE",
       "native_layout": "MTP_CORE_NATIVE_LAYOUT", "device": "MTP_CORE_DEVICE"}
NATIVE_STEP_ENV = "MTP_CORE_NATIVE_STEP"
DIST_TIMEOUT_ENV = "MTP_DIST_TIMEOUT_S"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

_configured = RuntimeConfig()          # the settings of the engine built last in this process
_hooks: list[Callable[[], None]] = []


def when_configured(hook: Callable[[], None]) -> Callable[[], None]:
    """Register `hook` to run after each configure() (the layers that hold process-wide state, below config)."""
    _hooks.append(hook)
    return hook


def configure(runtime: RuntimeConfig) -> None:
    """Make `runtime` the process's settings (an engine is being built from it), then apply them."""
    global _configured
    runtime.validate()
    _configured = copy.copy(runtime)
    for hook in _hooks:
        hook()


def _entry(name: str):
    return next(e for e in entries(RuntimeConfig) if e.name == name)


def _env(var: str) -> Optional[str]:
    raw = os.environ.get(var)
    return raw.strip() if raw and raw.strip() else None


def _bool(var: str, raw: str) -> bool:
    if raw.lower() in _TRUE + _FALSE:
        return raw.lower() in _TRUE
    raise ConfigError(f"{var}={raw!r}: use 1 or 0 (true or false)", var)


def _parse(name: str, var: str, raw: str) -> Any:
    entry = _entry(name)
    if entry.kind == "bool":
        return _bool(var, raw)
    if entry.spec.ok is not None and not entry.spec.ok(raw):
        raise ConfigError(f"{var}={raw!r}: use {entry.allowed}", var)
    return raw


def setting(name: str, runtime: Optional[RuntimeConfig] = None) -> Any:
    """The effective value of runtime.<name>: its environment variable where set, else `runtime`'s value (default:
    the configured settings)."""
    raw = _env(ENV[name])
    if raw is not None:
        return _parse(name, ENV[name], raw)
    return getattr(runtime if runtime is not None else _configured, name)


def source(name: str, runtime: Optional[RuntimeConfig] = None) -> str:
    """Where the effective value comes from, as a user would write it: "MTP_CORE_X=v" or "runtime.x=v"."""
    raw = _env(ENV[name])
    if raw is not None:
        return f"{ENV[name]}={raw}"
    value = getattr(runtime if runtime is not None else _configured, name)
    return f"runtime.{name}={str(value).lower() if isinstance(value, bool) else value}"


def kernels() -> str:
    """auto | reference: which kernels native_ops() loads (kernels/native.py)."""
    return setting("kernels")


def cpu_isa() -> str:
    """The cap on the native CPU kernels' instruction set (auto | amx | avx512 | avx512f | avx2 | generic)."""
    return setting("cpu_isa")


def native_decode() -> bool:
    """Whether the native CPU decode forward may serve a model (model/native_decode.py)."""
    return setting("native_decode")


def native_layout() -> str:
    """auto | direct | packed: the native forward's weight layout (model/native_weights.py: choose_layout)."""
    return setting("native_layout")


def device(cuda_available: Callable[[], bool], runtime: Optional[RuntimeConfig] = None) -> str:
    """The CLI's device: runtime.device, auto = cuda when `cuda_available()`, else cpu. A CUDA device without CUDA
    is a ConfigError naming where it was asked for."""
    want = setting("device", runtime)
    if want == "auto":
        return "cuda" if cuda_available() else "cpu"
    if want.startswith("cuda") and not cuda_available():
        raise ConfigError(f"{source('device', runtime)} but torch sees no CUDA device; unset it or use cpu",
                          ENV["device"])
    return want


def dist_timeout_s(default: float) -> float:
    """Seconds a collective of a torchrun run waits before it fails (MTP_DIST_TIMEOUT_S; distributed/launch.py):
    a dead rank must not hang the others. The variables torchrun itself sets (RANK, WORLD_SIZE, LOCAL_RANK) are
    its launcher's contract, read where the process group is set up."""
    raw = _env(DIST_TIMEOUT_ENV)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value > 0:
        return value
    raise ConfigError(f"{DIST_TIMEOUT_ENV}={raw!r}: use a number of seconds above 0", DIST_TIMEOUT_ENV)


def native_step(on: bool) -> bool:
    """LLMConfig.native_step as it applies: MTP_CORE_NATIVE_STEP=0 turns it off (a switch kept for A/B runs)."""
    raw = _env(NATIVE_STEP_ENV)
    return on if raw is None or not on else _bool(NATIVE_STEP_ENV, raw)
