#!/usr/bin/env bash
# The chunked prefill on the lent H200 (benchmarks/DEVICE.md), no carry: random-weight shapes only.
#   1. the GPU tests of a long prompt prefilled a chunk at a time without a cache (bf16: AR = DDTree =
#      a cold cache's run; 16-64 rows a chunk equal 512) and of hits inside a chunk;
#   2. benchmarks/prefill_bench.py on SmolLM2's shape (to 7,936 tokens) and the Qwen3.5-27B shape (4k
#      and 16k): chunked against one whole-prompt forward, time and the peak the prefill adds.
source benchmarks/device/sections.sh prefill
say "host: $(hostname)  python: $(python3 -V 2>&1)  torch: $(python3 -c 'import torch; print(torch.__version__)')"
section gpu_tests ${TESTS_LIMIT:-100} python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs \
  tests/engine/test_gpu_prefix_cache.py -k "long_prompt"
section prefill_smollm2 ${SMOL_LIMIT:-60} python3 benchmarks/prefill_bench.py --target smollm2-135m-shape \
  --draft random --device cuda --dtype bfloat16 --lengths 1024 4096 7936 --repeats 3 --md "$OUT/prefill_smollm2.md"
section prefill_27b ${BIG_LIMIT:-150} python3 benchmarks/prefill_bench.py --target qwen35-27b-shape \
  --draft random --device cuda --dtype bfloat16 --lengths 4096 16384 --repeats 1 --md "$OUT/prefill_27b.md"
summary
