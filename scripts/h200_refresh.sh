#!/usr/bin/env bash
# One point per memory-bound kernel, forward+backward, against the peers, in one device call: the issues'
# targets are H200 numbers, and the H200 table in docs/perf-notes.md predates most of s10-s24's changes. The
# norms also at 4096x65536, where the column-split backwards (s17) have not met torch.compile on an H200.
#   scripts/h200_refresh.sh          (about 7 minutes with installation)
cd "$(dirname "$0")/.."
BENCH_TIME_LIMIT=${BENCH_TIME_LIMIT:-420} bash scripts/gpu_check.sh bench --tag refresh \
  --kernels rms_norm layer_norm fused_add_rms_norm rope swiglu cross_entropy kl_div jsd \
  --match "^((rms_norm|layer_norm|fused_add_rms_norm) fwd\+bwd (65536x4096|4096x65536)|(cross_entropy|kl_div|jsd) fwd\+bwd \
8192x128256|rope fwd\+bwd B1 T65536 H32/8 D128|swiglu fwd\+bwd 32768x14336) \
(liger_torch|liger_kernel|torch_compile|xla)$"
