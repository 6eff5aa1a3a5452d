#!/usr/bin/env bash
# The next device sitting (simulated ranks, one GPU): every job in the background, results under $R, collected by
# `benchmarks/device_sitting.sh collect` (a tarball into $OUT). The sittings before it, with the job lists they ran:
# the NOTES.md of their results' folders, listed in benchmarks/results/README.md. Usage, on the device machine, after
# `source .dev-whl/device-setup.sh` (a sitting with a "revision" arm: carry .rev/):
#   benchmarks/device_sitting.sh start s34  # launches the sitting's jobs (returns at once)
#   benchmarks/device_sitting.sh collect    # waits up to $WAIT seconds for them, then tars what exists into $OUT
# The jobs of a sitting compile side by side but time alone: every paired run removes its file under $R/busy when
# its arms are built, waits until that folder is empty (nothing else compiling or running) and takes $R/gpu.lock
# for its timed iterations (paired.py --gpu-lock/--busy).
set -u
R=${R:-/tmp/sitting}
mkdir -p "$R/paired" "$R/logs" "$R/busy"
FLAGS="--distributed_mode=fsdp --shard_mode=zero3 --model_name=Llama-2-7b-hf --micro_batch_size=1 --compile=thunder_inductor_cat"
FP8="--low_precision_mode=fp8-default-te"
USER_ARMS='{"without": null, "null": null, "default": {}}'  # "default" is exactly {}: what a user writes
export PYTHONUNBUFFERED=1

paired() {  # name, arms, timed, [paired.py's own flags... --] flags... (timed alone, see above)
  local name=$1 arms=$2 timed=$3; shift 3
  local own=()
  if [[ " $* " == *" -- "* ]]; then while [ "$1" != "--" ]; do own+=("$1"); shift; done; shift; fi
  python3 benchmarks/paired.py --simulate 8 --timed "$timed" --gpu-lock "$R/gpu.lock" --busy "$R/busy/$JOB" \
    "${own[@]}" --arms "$arms" --out "$R/paired/$name" -- "$@" > "$R/logs/$name.log" 2>&1
  echo "$name rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}

gpu_tests() {
  mkdir -p "$R/gpu"
  OUT="$R/gpu" python3 -m pytest -q tests/test_te_gpu.py tests/test_multicopy.py -k "not nccl" -n ${GPU_TEST_WORKERS:-1} -p no:cacheprovider -s --durations=20 \
    > "$R/logs/test_te_gpu.log" 2>&1
  echo "gpu_tests rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}

# s34 (done: benchmarks/results/h100_2026-12-07/s34/): the capacity search resumed from s33's records, then the
# winners' paired runs one after another (capacity.py rows --commands); the lease ended after the first pair.
# s36 (next, on an H100 as s33-s34): the search resumed from s34's records with expandable segments (`_xs`: only where
# the default allocator's reserved bytes ran out of a cap the allocated peak fits; 4 configurations, 5 runs), then the
# pairs not timed yet (s34's paired JSONs carried into $R/paired: rows --paired skips them, and the FP8 and bf16
# defaults where an H100's s35 launch timed them), largest ranked gain first.
# s35 (issue #62, on whichever card comes; s36 waits for an H100 like s33's): the GPU module on main (shard ops merged
# on their own terms) beside the FP8 default's and bf16's launches, each with a fourth arm "again": main with the calls
# made again (ops._Again, pending/ops_again.patch, not landed), a revision arm read from .rev/again.tar; then the GPU
# module on that code (.rev/again_tests.tar over a copy of the tree). Made here, before the call (carry .rev):
#   git checkout -b again && patch -p1 < pending/ops_again.patch && git commit -qam again && git checkout main
#   git archive -o .rev/again.tar again thunder_fp8shard && git archive -o .rev/again_tests.tar again thunder_fp8shard tests
# Start s35b (the same less main's module: main + the patch is the code that lands if its module passes); s35c, s35d
# and s35e are shorter still, for a lease of a few minutes (2026-12-08: ten refusals ate that session's 30 minutes).
AGAIN_ARMS='{"without": null, "null": null, "default": {}, "again": {"revision": "again"}}'
fp8() { paired fp8_l32_n8_s35 "$AGAIN_ARMS" 40 --one-model -- $FLAGS $FP8 --n_layers=32; }
bf16() { paired bf16_l32_n8_s35 "$AGAIN_ARMS" 40 --one-model -- $FLAGS --n_layers=32; }
again_tests() {  # the GPU module on main + the patch, after main's where it runs (one module at a time beside the builds)
  while [ -e "$R/busy/gpu_tests" ]; do sleep 5; done
  rm -rf "$R/again" && cp -r "$R/tree" "$R/again" && tar xf "$R/tree/.rev/again_tests.tar" -C "$R/again"
  mkdir -p "$R/gpu_again"
  (cd "$R/again" && PYTHONPATH="$R/again:$PYTHONPATH" OUT="$R/gpu_again" python3 -m pytest -v ${AGAIN_TESTS:-tests/test_multicopy.py \
    tests/test_te_gpu.py} -k "not nccl" -n ${GPU_TEST_WORKERS:-1} -p no:cacheprovider -s --durations=20 \
    > "$R/logs/test_te_gpu_again.log" 2>&1)
  echo "again_tests rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}
capacity_search() {
  python3 benchmarks/capacity.py search --simulate 8 --out "$R/capacity" --parallel ${PARALLEL:-8} \
    --expandable ${EXPANDABLE:-off} > "$R/logs/capacity.log" 2>&1
  echo "capacity_search rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}

capacity_timing() {  # after the search: each pair of winners timed alone, one after another
  rm -f "$R/busy/$JOB"
  until grep -q "capacity_search rc=" "$R/logs/done" 2>/dev/null; do sleep 10; done
  python3 benchmarks/capacity.py rows --search "$R/capacity" --paired "$R/paired" --commands \
    > "$R/logs/paired_commands.sh" 2> "$R/logs/rows.err"
  local k=0 cmd
  while read -r cmd; do k=$((k + 1)); eval "$cmd" > "$R/logs/paired_$k.log" 2>&1; echo "pair $k exit=$?" >> "$R/logs/done"; done \
    < "$R/logs/paired_commands.sh"
  echo "capacity_timing rc=0" >> "$R/logs/done"
}

launch() {  # job names (the functions above): each in the background, every busy file made first, each run from a
  # private copy of the tree ($R/tree): the device tool copies the working tree again at every call, and a job
  # importing a file while the next call rewrites it fails (sitting s9: an ImportError in one pytest worker)
  local job
  rm -rf "$R/tree" && mkdir -p "$R/tree"
  tar cf - --exclude=./.git --exclude=./.dev-te --exclude=./.dev-whl --exclude=./.venv . | tar xf - -C "$R/tree"
  for job in "$@"; do touch "$R/busy/$job"; done
  for job in "$@"; do
    setsid nohup bash -c "cd '$R/tree'; export PYTHONPATH='$R/tree':\$PYTHONPATH; $(declare -f paired gpu_tests again_tests capacity_search capacity_timing fp8 bf16 "$job"); R=$R JOB=$job FLAGS='$FLAGS' FP8='$FP8' USER_ARMS='$USER_ARMS' AGAIN_ARMS='$AGAIN_ARMS' EXPANDABLE=${EXPANDABLE:-off} AGAIN_TESTS='${AGAIN_TESTS:-}' GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-1}; $job" \
      > "$R/logs/chain_$job.log" 2>&1 &
  done
}

case "${1:-}" in
  start)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/logs/device.txt" 2>&1
    case "${2:-}" in
      # one after another after the first build (each waits for the one before it to finish)
      s34) mkdir -p "$R/capacity" && cp benchmarks/results/h100_2026-12-07/s33/capacity/*.json "$R/capacity/"
           launch capacity_search capacity_timing; echo 2 > "$R/logs/expected" ;;
      s36) mkdir -p "$R/capacity" && cp benchmarks/results/h100_2026-12-07/s34/capacity/*.json "$R/capacity/"
           cp benchmarks/results/h100_2026-12-07/s34/paired/*.json "$R/paired/"
           cp benchmarks/results/h100_*/s35*/paired/*.json "$R/paired/" 2>/dev/null  # #62's launches on an H100, if any
           export EXPANDABLE=off,on; launch capacity_search capacity_timing; echo 2 > "$R/logs/expected" ;;
      s35) export GPU_TEST_WORKERS=12; launch gpu_tests again_tests fp8 bf16; echo 4 > "$R/logs/expected" ;;
      # s35 less main's GPU module, for a short lease: main + the patch is the code that lands if its module passes
      s35b) export GPU_TEST_WORKERS=12; launch again_tests fp8 bf16; echo 3 > "$R/logs/expected" ;;
      s35c) export GPU_TEST_WORKERS=12; launch again_tests fp8; echo 2 > "$R/logs/expected" ;;  # shorter still
      s35d) export GPU_TEST_WORKERS=12; launch again_tests; echo 1 > "$R/logs/expected" ;;  # the patch's module alone
      s35e) export GPU_TEST_WORKERS=12 AGAIN_TESTS=tests/test_multicopy.py; launch again_tests; echo 1 > "$R/logs/expected" ;;
      *) echo "usage: $0 start s34|s35|s35b|s35c|s35d|s35e|s36"; exit 2 ;;
    esac
    echo started ;;
  collect)
    want=$(cat "$R/logs/expected")
    end=$((SECONDS + ${WAIT:-540}))
    # a snapshot into $OUT every 30 s while waiting: a lease that ends mid-call still returns what was done
    (while sleep 30; do tar czf "$OUT/partial.tgz.tmp" --exclude=./tree -C "$R" . && mv "$OUT/partial.tgz.tmp" \
      "$OUT/partial.tgz"; done) & snap=$!
    while [ $SECONDS -lt $end ] && [ "$(grep -c rc= "$R/logs/done" 2>/dev/null || echo 0)" -lt "$want" ]; do sleep 5; done
    cat "$R/logs/done" 2>/dev/null; ls "$R/busy"
    grep -h "\[paired\]" "$R"/logs/*.log | cut -c1-200
    tail -n 2 "$R"/logs/*.log | cut -c1-300
    nvidia-smi --query-gpu=memory.used --format=csv
    kill $snap; rm -f "$OUT/partial.tgz.tmp" "$OUT/partial.tgz"
    tar czf "$OUT/sitting.tgz" --exclude=./tree -C "$R" . && ls -la "$OUT" ;;
  *) echo "usage: $0 start s34|s35|s35b|s35c|s35d|s35e|s36|collect"; exit 2 ;;
esac
