"""Process-level settings the simulators need, applied before they are imported.

- SAPIEN needs a Vulkan device even for state observations. On machines without a GPU driver,
  ``scripts/setup_vulkan.sh`` puts Mesa's software Vulkan (lavapipe) into ``.vulkan/``; here we
  point the Vulkan loader at it. On a workstation with a real driver nothing is changed.
- MuJoCo renders headless through EGL.
- ManiSkill assets go to a project folder and never block on a download prompt.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_done = False


def software_vulkan_dir() -> Path | None:
    d = Path(os.environ.get("GROUNDFLOW_VULKAN_DIR", ROOT / ".vulkan"))
    return d if (d / "lvp_icd.json").is_file() else None


def _has_gpu_vulkan() -> bool:
    return any(Path(p).is_file() for p in (
        "/usr/share/vulkan/icd.d/nvidia_icd.json", "/etc/vulkan/icd.d/nvidia_icd.json",
        "/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json"))


def setup() -> None:
    """Idempotent; call before importing sapien / mani_skill / mujoco."""
    global _done
    if _done:
        return
    _done = True
    os.environ.setdefault("MS_SKIP_ASSET_DOWNLOAD_PROMPT", "1")
    os.environ.setdefault("MS_ASSET_DIR", str(ROOT / ".assets" / "maniskill"))
    os.environ.setdefault("MESA_SHADER_CACHE_DIR", str(ROOT / ".assets" / "mesa_cache"))
    if "DISPLAY" not in os.environ:
        os.environ.setdefault("MUJOCO_GL", "egl")
        os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
    # ManiSkill's CPU IK does ~55 tiny numpy solves per ee-control step; a multi-threaded BLAS
    # makes each 5-40x slower on 2 shared cores (measured 41 vs 130-150 steps/s).
    if os.environ.get("GROUNDFLOW_BLAS_THREADS", "1") != "auto":
        try:
            import numpy  # noqa: F401  (load its BLAS first: the limit applies to loaded libraries only)
            from threadpoolctl import threadpool_limits
            threadpool_limits(int(os.environ.get("GROUNDFLOW_BLAS_THREADS", "1")), user_api="blas")
        except ImportError:
            pass
    vk = software_vulkan_dir()
    if vk is not None and "VK_ICD_FILENAMES" not in os.environ and not _has_gpu_vulkan():
        icd = str(vk / "lvp_icd.json")
        os.environ["VK_ICD_FILENAMES"] = icd
        os.environ["VK_DRIVER_FILES"] = icd
        lib = vk / "usr" / "lib" / "x86_64-linux-gnu"
        # The ICD JSON names libvulkan_lvp.so by absolute path, but its dependencies (the
        # backported libdrm) are looked up by soname. LD_LIBRARY_PATH is read only at process
        # start, so load them now: later dlopen calls then reuse these already-loaded copies.
        os.environ["LD_LIBRARY_PATH"] = str(lib) + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else "")
        import ctypes
        for name in ("libdrm.so.2", "libdrm_amdgpu.so.1"):
            if (lib / name).exists():
                ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
