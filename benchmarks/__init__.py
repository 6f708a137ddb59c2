"""Benchmarks: ``python -m benchmarks run [--kernels rms_norm ...] [--quick]`` on a CUDA GPU, ``--smoke`` for tiny
shapes on the CPU, ``python -m benchmarks render <results.json>`` to redraw a report (see ``__main__``)."""
