"""GPU tests: deterministic cuBLAS must be configured before CUDA initialises."""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
