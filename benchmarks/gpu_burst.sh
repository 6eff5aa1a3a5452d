#!/usr/bin/env bash
# One GPU burst (H200, after `source .dev-whl/device-setup.sh`): the TE GPU tests, the seq-4096 benchmark with and
# without the pass (gloo, 2 ranks on the one GPU), prefetch 0 / 2 with the pass, and a world-size-1 NCCL dry run of
# the torchrun path. Everything is logged to $OUT/all.log (lines tagged by job); JSON files land in $OUT.
# Usage: OUT=/some/dir SEQ=4096 bash benchmarks/gpu_burst.sh
set -u
OUT=${OUT:-/tmp/out}; SEQ=${SEQ:-4096}; export OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/all.log"
B="python3 benchmarks/bench_litgpt.py --model-name Llama-2-7b-hf --n-layer 2 --micro-batch-size 1 --steps 3"
job() {  # job TAG TIMEOUT_S CMD...: runs CMD with a timeout, its lines tagged in all.log; its status is logged
  local tag=$1 t=$2; shift 2
  local t0=$SECONDS
  ( set -o pipefail; timeout "$t" "$@" 2>&1 | sed -u "s/^/[$tag] /" >> "$LOG"; echo "[$tag] rc=$? after $((SECONDS - t0)) s" >> "$LOG" )
}
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv; date; } 2>&1 | sed "s/^/[env] /" >> "$LOG"

# phase A (concurrent): test (small), seq-SEQ benchmark without+with, NCCL world-size-1 dry run at seq 1024
job test 300 python3 -m pytest -q -s -rA tests/test_te_gpu.py &
job b$SEQ 300 $B --seq-len "$SEQ" --both --out "$OUT/bench_seq$SEQ.json" &
job nccl 300 python3 -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/bench_litgpt.py \
    --backend nccl --n-layer 2 --seq-len 1024 --steps 2 --out "$OUT/bench_nccl_ws1.json" &
wait
echo "[env] phase A done at $SECONDS s" >> "$LOG"

# phase B: prefetch 0 and 2 with the pass; concurrently when 4 such processes fit in the GPU's memory
conc=$(python3 -c "
import json,sys
try:
    d=json.load(open('$OUT/bench_seq$SEQ.json')); p=d['with']['peak_bytes_max_over_ranks']
    print(int(4*p*1.3 < 125e9))
except Exception as e:
    print(0)")
echo "[env] phase B concurrent=$conc" >> "$LOG"
if [ "$conc" = 1 ]; then
  job pf0 200 $B --seq-len "$SEQ" --shard --prefetch 0 --out "$OUT/bench_seq${SEQ}_pf0.json" &
  job pf2 200 $B --seq-len "$SEQ" --shard --prefetch 2 --out "$OUT/bench_seq${SEQ}_pf2.json" &
  wait
else
  job pf0 130 $B --seq-len "$SEQ" --shard --prefetch 0 --out "$OUT/bench_seq${SEQ}_pf0.json"
  job pf2 110 $B --seq-len "$SEQ" --shard --prefetch 2 --out "$OUT/bench_seq${SEQ}_pf2.json"
fi
echo "[env] all done at $SECONDS s" >> "$LOG"
grep -E "rc=|phase|done" "$LOG"
