#!/usr/bin/env bash
# Follow-up call 5, carrying .device/smol2 .device/gguf, right after call 4: joins and installs
# SmolLM2 (sha256 checked by `engine assets fetch`); the GPU tests but the grammar ones.
source benchmarks/device/common.sh call5
join_smollm2
install_assets smollm2
section gpu_tests 60 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py -k 'not grammar'
summary
