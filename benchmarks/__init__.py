"""Benchmarks: ``python -m benchmarks run [--kernels rms_norm ...] [--quick]`` (needs a CUDA GPU)."""
