"""The CUDA toolkit that the build-only tests compile with, without a GPU.

This is a helper module, not a test module (pytest puts tests/ on sys.path).
"""
import glob
import os
import shutil

# nvcc on PATH, else the toolkit's usual home, else any versioned one; None without a toolkit.
NVCC = (shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc",
                                                  *sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))]
                                      if os.path.exists(p)), None))
NEEDS_NVCC = "needs nvcc (the CUDA toolkit)"


def tool(name):
    """The path of one of NVCC's own toolkit programs (ptxas, cuobjdump), the
    one nvcc runs, or None."""
    path = os.path.join(os.path.dirname(NVCC), name) if NVCC else None
    return path if path and os.path.exists(path) else None
