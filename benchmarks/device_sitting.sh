#!/usr/bin/env bash
# One sitting on one H200 (simulated ranks): every job in the background, results under $R, collected by
# `benchmarks/device_sitting.sh collect` (a tarball into $OUT). See benchmarks/README.md ("The sitting of the
# third session"). Usage, on the device machine, after `source .dev-whl/device-setup.sh`:
#   benchmarks/device_sitting.sh start      # launches the jobs (returns at once)
#   benchmarks/device_sitting.sh collect    # waits up to $WAIT seconds for them, then tars what exists into $OUT
set -u
R=${R:-/tmp/sitting}
mkdir -p "$R/paired" "$R/logs"
FLAGS="--distributed_mode=fsdp --shard_mode=zero3 --model_name=Llama-2-7b-hf --micro_batch_size=1 --compile=thunder_inductor_cat"
FP8="--low_precision_mode=fp8-default-te"
export PYTHONUNBUFFERED=1
PAIRED_EXTRA=""

paired() {  # name, arms, timed, flags...
  local name=$1 arms=$2 timed=$3; shift 3
  python3 benchmarks/paired.py --simulate 8 --timed "$timed" $PAIRED_EXTRA --arms "$arms" --out "$R/paired/$name" \
    -- "$@" > "$R/logs/$name.log" 2>&1
  echo "$name rc=$?" >> "$R/logs/done"
}

fp8_32() {
  paired paired_fp8_l32_n8_compaction '{"without": null, "compact": {"pass": "compact", "optimizer_states": 2},
    "all": {"optimizer_states": 2}, "budget3": {"optimizer_states": 2, "policy": "budget",
    "budget_below_base_bytes": 3000000000}}' 40 $FLAGS $FP8 --n_layers=32
}

fp8_8() {
  paired paired_fp8_l8_n8_budgets '{"without": null, "null": null, "compact": {"pass": "compact", "optimizer_states": 2},
    "all": {"optimizer_states": 2}, "k4": {"optimizer_states": 2, "shard_group_size": 4},
    "k2": {"optimizer_states": 2, "shard_group_size": 2},
    "budget0.25": {"optimizer_states": 2, "policy": "budget", "budget_below_base_bytes": 250000000},
    "budget0.5": {"optimizer_states": 2, "policy": "budget", "budget_below_base_bytes": 500000000},
    "budget1": {"optimizer_states": 2, "policy": "budget", "budget_below_base_bytes": 1000000000}}' 40 $FLAGS $FP8 --n_layers=8
}

bf16_32() {
  paired paired_bf16_l32_n8_compaction '{"without": null, "compact": {"pass": "compact", "optimizer_states": 2},
    "all": {"optimizer_states": 2, "candidates": "all"}}' 40 $FLAGS --n_layers=32
}

setups_8() {  # memory of every setup (FP8; 8 layers, DDP 4): few timed iterations, memory is the question
  local PAIRED_EXTRA="--warmup-quads 1"
  paired setup_zero2_fp8_l8_n8 '{"without": null, "with": {"optimizer_states": 2}}' 4 \
    --distributed_mode=fsdp --shard_mode=zero2 --model_name=Llama-2-7b-hf --micro_batch_size=1 \
    --compile=thunder_inductor_cat $FP8 --n_layers=8
  # DDP holds the whole model on every rank: 4 layers, so that it fits beside the bf16 run
  paired setup_ddp_fp8_l4_n8 '{"without": null, "with": {"optimizer_states": 2}}' 4 \
    --distributed_mode=ddp --model_name=Llama-2-7b-hf --micro_batch_size=1 --compile=thunder_inductor_cat $FP8 --n_layers=4
  paired setup_fsdp2_fp8_l8_n8 '{"without": null, "with": {"optimizer_states": 2}}' 4 \
    --distributed_mode=fsdp2 --shard_mode=zero3 --model_name=Llama-2-7b-hf --micro_batch_size=1 \
    --compile=dynamo_thunder_inductor_cat $FP8 --n_layers=8
}

gpu_tests() {
  mkdir -p "$R/gpu"
  OUT="$R/gpu" python3 -m pytest -q tests/test_te_gpu.py -k "not nccl" -p no:cacheprovider -s --durations=20 \
    > "$R/logs/test_te_gpu.log" 2>&1
  echo "gpu_tests rc=$?" >> "$R/logs/done"
}

case "${1:-}" in
  start)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/logs/device.txt" 2>&1
    # the 32-layer FP8 run, the 8-layer runs and the GPU tests compile at once (CPU-bound); the 8-layer runs and
    # the tests end before the 32-layer run's timed iterations start. bf16 and the setups follow the 32-layer run.
    setsid nohup bash -c "$(declare -f paired fp8_32 bf16_32 setups_8); R=$R FLAGS='$FLAGS' FP8='$FP8' PAIRED_EXTRA=''; fp8_32; \
      setups_8 & bf16_32; wait" > "$R/logs/chain_a.log" 2>&1 &
    setsid nohup bash -c "$(declare -f paired fp8_8 gpu_tests); R=$R FLAGS='$FLAGS' FP8='$FP8' PAIRED_EXTRA=''; gpu_tests & fp8_8; wait" \
      > "$R/logs/chain_b.log" 2>&1 &
    echo started ;;
  collect)
    end=$((SECONDS + ${WAIT:-540}))
    while [ $SECONDS -lt $end ] && [ "$(grep -c rc= "$R/logs/done" 2>/dev/null || echo 0)" -lt 7 ]; do sleep 10; done
    cat "$R/logs/done" 2>/dev/null
    tail -n 3 "$R"/logs/*.log | cut -c1-300
    tar czf "$OUT/sitting.tgz" -C "$R" . && ls -la "$OUT" ;;
  *) echo "usage: $0 start|collect"; exit 2 ;;
esac
