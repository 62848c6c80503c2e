"""Native extensions of mtp_core, for setup.py.

    from setup_ext import get_extensions
    ext_modules, cmdclass = get_extensions()
    setup(..., ext_modules=ext_modules, cmdclass=cmdclass)

* `mtp_core._C` (C++, always): the op schemas (csrc/registration.cpp) and the CPU kernels.
* `mtp_core._C_cuda` (C++/CUDA): only when torch was built with CUDA and CUDA_HOME is found.
  Targets `MTP_CORE_CUDA_ARCHS` (default "90a;100a": H100/H200 and B200), minus the ones the
  local nvcc cannot build.
* `MTP_CORE_BUILD_EXT=0` skips native code entirely; so does a missing torch.

Every extension is optional: a compiler error is logged and the install goes on; mtp_core.kernels
then uses the torch reference and says so when imported.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

log = logging.getLogger("mtp_core.setup")
ROOT = Path(__file__).resolve().parent
_DEFAULT_ARCHS = "90a;100a"
# Oldest nvcc release that knows each arch-specific target.
_MIN_NVCC = {"90a": (12, 0), "100a": (12, 8)}


def _say(message: str) -> None:
    # pip hides logging output from setup.py unless -v; print reaches the build log either way.
    print(f"mtp_core setup: {message}")
    log.info(message)


def _sources(pattern: str) -> list[str]:
    # setuptools wants source paths relative to the directory of setup.py.
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob(pattern))


def _nvcc_version(cuda_home: str) -> tuple[int, int] | None:
    try:
        text = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def cuda_archs(cuda_home: str) -> list[str]:
    """Arch-specific targets to build, e.g. ["90a", "100a"], filtered by what nvcc supports."""
    wanted = [a.strip() for a in os.environ.get("MTP_CORE_CUDA_ARCHS", _DEFAULT_ARCHS).split(";") if a.strip()]
    version = _nvcc_version(cuda_home)
    archs = [a for a in wanted if version is None or version >= _MIN_NVCC.get(a, (0, 0))]
    for arch in sorted(set(wanted) - set(archs)):
        _say(f"nvcc {version} cannot build sm_{arch}; skipping it")
    return archs


def _tolerant_build_ext(base: type) -> type:
    """torch's BuildExtension, except that a failed (optional) extension is reported, not fatal."""

    class TolerantBuildExt(base):  # type: ignore[misc, valid-type]
        def build_extension(self, ext: Any) -> None:
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - ninja failures surface as RuntimeError
                if not getattr(ext, "optional", False):
                    raise
                _say(f"building {ext.name} failed ({type(exc).__name__}: {exc}); "
                     "mtp_core.kernels will use the torch reference for its ops")

    return TolerantBuildExt


def get_extensions() -> tuple[list[Any], dict[str, type]]:
    """(ext_modules, cmdclass) for setuptools.setup; ([], {}) when native code is skipped."""
    if os.environ.get("MTP_CORE_BUILD_EXT", "1") == "0":
        _say("MTP_CORE_BUILD_EXT=0: not building native extensions (torch reference kernels only)")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        _say(f"torch is not importable ({exc}); not building native extensions")
        return [], {}

    # no fused multiply-add contraction: the fused CPU ops round each product as the torch references do
    cxx_flags = ["-O3", "-std=c++20", "-ffp-contract=off"]
    # OpenMP: at::parallel_for is inline OpenMP in torch's headers, so without -fopenmp the native forward's
    # thread team would be one thread; -lgomp resolves to the libgomp.so.1 torch already loaded (same soname,
    # one runtime, one thread pool)
    extensions = [
        CppExtension("mtp_core._C", sources=_sources("*.cpp") + _sources("cpu/*.cpp"),
                     extra_compile_args={"cxx": cxx_flags + ["-fopenmp"]}, extra_link_args=["-fopenmp"],
                     optional=True),
    ]
    if torch.version.cuda and CUDA_HOME:
        archs = cuda_archs(CUDA_HOME)
        if archs:
            gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
            arch_define = "-DMTP_CORE_CUDA_ARCHS=" + "_".join(archs)
            extensions.append(CUDAExtension(
                "mtp_core._C_cuda", sources=_sources("cuda/*.cu") + _sources("cuda/*.cpp"),
                extra_compile_args={"cxx": cxx_flags + [arch_define], "nvcc": ["-O3", "-std=c++20", *gencode]},
                optional=True))
            _say(f"building mtp_core._C and mtp_core._C_cuda (sm_{', sm_'.join(archs)})")
        else:
            _say("no CUDA arch left to build; building mtp_core._C only")
    else:
        _say("torch has no CUDA or CUDA_HOME is unset; building mtp_core._C only")
    return extensions, {"build_ext": _tolerant_build_ext(BuildExtension)}
