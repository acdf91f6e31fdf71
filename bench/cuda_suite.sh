#!/usr/bin/env bash
# Issue 41's measurements on a lent GPU machine, in one call, in order of worth, each part capped
# so the call ends inside its budget (parts that no longer fit are skipped and say so):
#
#   step      bench/train_overhead.py --device cuda: the 125m and 1b steps (seq 2048, bf16) beside
#             the same run's naive loop, compiled (step-eager: eager; step-ce: the full-logits loss)
#   profile   tpud profile of the compiled 125m step: where its time goes
#   parity    bench/cuda_parity.py: FSDP2 + compile on a mesh of one against eager, 20 steps, bf16
#             (parity-fp32: in fp32; parity-det: bf16 with device.deterministic; parity-eager-rounding:
#             that, and Inductor rounding its intermediates as eager does)
#   loss      bench/cce.py --device cuda: the losses alone at bf16 V=128k N=16k D=2048
#   resume    bench/cuda.py: 125m under tpud run, 200 steps, one SIGKILL (step time after / before)
#   bitwise   bench/cuda.py: tiny under tpud run with device.deterministic, killed and not: weights
#
#   bash bench/cuda_suite.sh OUT_DIR [SECONDS] [PARTS]
#
# The machine lacks some of the project's dependencies: wheels in .whl/ (cp312) are installed into
# /tmp/site first when present. Results: OUT_DIR/results.tgz (every JSON) and OUT_DIR/log.txt.
set -u
out=${1:?usage: cuda_suite.sh OUT_DIR [SECONDS] [PARTS]}
budget=${2:-420}
parts=${3:-step profile parity parity-fp32 parity-det parity-eager-rounding loss resume bitwise step-eager step-ce}
cd "$(dirname "$0")/.."
mkdir -p "$out/results"
exec > >(tee -a "$out/log.txt") 2>&1
deadline=$((SECONDS + budget))
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
# One compile cache for the in-process benches: a part reuses what an earlier one compiled.
cache=/tmp/tpud-compile-cache

part() {  # part NAME CAP COMMAND...: run COMMAND for at most CAP seconds, if that much is left
    local name=$1 cap=$2 left=$((deadline - SECONDS))
    shift 2
    [[ " $parts " == *" $name "* ]] || return 0
    if ((left < cap / 2)); then
        echo "=== $name: skipped, ${left}s left (needs ~${cap}s)"
        return 0
    fi
    ((cap > left)) && cap=$left
    echo "=== $name (at most ${cap}s, $(date +%T))"
    local started=$SECONDS
    timeout --kill-after=10 "$cap" "$@"
    echo "=== $name: exit $?, $((SECONDS - started))s"
    tar -czf "$out/results.tgz" -C "$out" results  # after every part: a call cut short keeps what ran
}

with_cache=(env "TORCHINDUCTOR_CACHE_DIR=$cache/inductor" "TRITON_CACHE_DIR=$cache/triton")

part step 150 "${with_cache[@]}" python3 bench/train_overhead.py --device cuda --compile --presets 125m,1b \
    --warmup 3 --steps 12 --out "$out/results/train_overhead-cuda-compile.json"
job=/tmp/cuda-125m.yaml
cat > $job <<EOF
name: cuda-125m
include: [$PWD/configs/models/125m.yaml, $PWD/configs/attention/auto.yaml]
data: {seq_len: 2048, micro_batch_size: 16}
train: {max_steps: 1000, log_interval: 10, seed: 0}
device: {backend: cuda}
EOF
part profile 70 "${with_cache[@]}" python3 -m tpud profile $job --warmup 3 --steps 4 --out /tmp/profile
cp /tmp/profile/report.json "$out/results/profile-125m.json" 2>/dev/null
part parity 80 "${with_cache[@]}" python3 bench/cuda_parity.py --micro-batch-size 16 --out "$out/results/cuda_parity.json"
part parity-fp32 150 "${with_cache[@]}" python3 bench/cuda_parity.py --micro-batch-size 16 --precision fp32 \
    --out "$out/results/cuda_parity-fp32.json"
part parity-det 90 "${with_cache[@]}" python3 bench/cuda_parity.py --micro-batch-size 16 --deterministic \
    --out "$out/results/cuda_parity-deterministic.json"
part parity-eager-rounding 90 "${with_cache[@]}" python3 bench/cuda_parity.py --micro-batch-size 16 --deterministic \
    --eager-rounding --out "$out/results/cuda_parity-eager-rounding.json"
part loss 130 python3 bench/cce.py --device cuda --compile --cases "bf16 V=128k N=16k D=2048" \
    --out "$out/results/cce-cuda.json"
# Under tpud run too: the operator's cache setting wins over the job's own (warm from the parts above).
part resume 110 "${with_cache[@]}" python3 bench/cuda.py --presets 125m --seq-len 2048 --micro-batch-size 16 --steps 200 \
    --interval 100 --arms killed --no-export --out "$out/results/cuda-resume.json"
part bitwise 90 "${with_cache[@]}" python3 bench/cuda.py --presets tiny --deterministic --steps 120 --interval 50 --no-export \
    --out "$out/results/cuda-bitwise.json"
part step-eager 90 "${with_cache[@]}" python3 bench/train_overhead.py --device cuda --presets 125m,1b \
    --warmup 2 --steps 6 --out "$out/results/train_overhead-cuda.json"
part step-ce 90 "${with_cache[@]}" python3 bench/train_overhead.py --device cuda --compile --presets 125m,1b \
    --warmup 3 --steps 12 --set loss.name=ce --out "$out/results/train_overhead-cuda-compile-ce.json"
tar -czf "$out/results.tgz" -C "$out" results && rm -rf "$out/results"
echo "=== done, $((deadline - SECONDS))s of ${budget}s left"
