"""GPU tests: cuBLAS picks deterministic kernels only with a fixed workspace, and reads the setting
once, when CUDA starts; so it is set here, before any test touches the GPU."""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
