#!/usr/bin/env bash
# Issue 7's GPU figures in one call: the gpt2-124m step (64 x 1024, bf16, compiled) against the transformers
# reference, then our step with the plain loss and uncompiled. JSON per run in $OUT (default benchmarks/out).
#   bash benchmarks/gpu.sh            # on the GPU machine, torch with CUDA installed in the active Python
set -euo pipefail
out=${OUT:-benchmarks/out}
mkdir -p "$out"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
run() {
    local name=$1
    shift
    echo "== $name: gptforge bench --config gpt2-124m $*"
    PYTHONPATH=src python -m gptforge bench --config gpt2-124m "$@" --json >"$out/$name.json"
    python -c "import json, sys; r = json.load(open(sys.argv[1])); o = r['ours']; \
print(f\"ours {o['tokens_per_s']:,.0f} tok/s {o['ms']:.0f} ms/step MFU {o['mfu']:.1%} peak {r['ours_peak_memory_mb']:,.0f} MB\", \
f\"| speed-up {r['speedup']:.2f}x\" if 'speedup' in r else '')" "$out/$name.json"
}
run compiled_fused
run compiled_plain --no-reference --set model.fused_loss=false
run eager_fused --no-reference --set train.compile=false
