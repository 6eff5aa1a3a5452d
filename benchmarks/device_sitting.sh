#!/usr/bin/env bash
# The device sittings on one H200 (simulated ranks), s1 to s24 (s22 was paired.py alone): every job in the background,
# results under $R, collected by `benchmarks/device_sitting.sh collect` (a tarball into $OUT). What each sitting ran
# and found: the NOTES.md of its folder, listed in benchmarks/results/README.md. Usage, on the device machine, after
# `source .dev-whl/device-setup.sh` (sittings with an "old" arm: carry .rev/, see OLD below):
#   benchmarks/device_sitting.sh start s16  # launches sitting s16's jobs (returns at once); any sitting likewise
#   benchmarks/device_sitting.sh collect    # waits up to $WAIT seconds for them, then tars what exists into $OUT
# The jobs of a sitting compile side by side but time alone: every paired run removes its file under $R/busy when
# its arms are built, waits until that folder is empty (nothing else compiling or running) and takes $R/gpu.lock
# for its timed iterations (paired.py --gpu-lock/--busy).
set -u
R=${R:-/tmp/sitting}
mkdir -p "$R/paired" "$R/logs" "$R/busy"
FLAGS="--distributed_mode=fsdp --shard_mode=zero3 --model_name=Llama-2-7b-hf --micro_batch_size=1 --compile=thunder_inductor_cat"
FP8="--low_precision_mode=fp8-default-te"
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

memory_only() {  # name, flags...: two arms, a few iterations, not timed alone (their times are no evidence)
  local name=$1; shift
  python3 benchmarks/paired.py --simulate 8 --timed 4 --warmup-quads 1 \
    --arms '{"without": null, "with": {"optimizer_states": 2}}' --out "$R/paired/$name" -- "$@" > "$R/logs/$name.log" 2>&1
  echo "$name rc=$?" >> "$R/logs/done"
}

fp8_8() {
  paired paired_fp8_l8_n8_budgets '{"without": null, "null": null, "compact": {"pass": "compact", "optimizer_states": 2},
    "all": {"optimizer_states": 2}, "k4": {"optimizer_states": 2, "shard_group_size": 4},
    "k2": {"optimizer_states": 2, "shard_group_size": 2},
    "budget0.25": {"optimizer_states": 2, "policy": "budget", "budget_below_base_bytes": 250000000},
    "budget0.5": {"optimizer_states": 2, "policy": "budget", "budget_below_base_bytes": 500000000},
    "budget1": {"optimizer_states": 2, "policy": "budget", "budget_below_base_bytes": 1000000000}}' 40 $FLAGS $FP8 --n_layers=8
}

bf16_8() {
  paired paired_bf16_l8_n8_compaction '{"without": null, "compact": {"pass": "compact", "optimizer_states": 2},
    "all": {"optimizer_states": 2, "candidates": "all"}}' 40 $FLAGS --n_layers=8
}

setups_8() {  # memory of every setup (FP8, 8 layers; DDP 4: it holds the whole model on every rank), one after another
  memory_only setup_zero2_fp8_l8_n8 --distributed_mode=fsdp --shard_mode=zero2 --model_name=Llama-2-7b-hf \
    --micro_batch_size=1 --compile=thunder_inductor_cat $FP8 --n_layers=8
  memory_only setup_ddp_fp8_l4_n8 --distributed_mode=ddp --model_name=Llama-2-7b-hf --micro_batch_size=1 \
    --compile=thunder_inductor_cat $FP8 --n_layers=4
  memory_only setup_fsdp2_fp8_l8_n8 --distributed_mode=fsdp2 --shard_mode=zero3 --model_name=Llama-2-7b-hf \
    --micro_batch_size=1 --compile=dynamo_thunder_inductor_cat $FP8 --n_layers=8
  rm -f "$R/busy/$JOB"
}

fp8_32() {  # compaction alone and with sharding (policy all) against without
  paired paired_fp8_l32_n8_compaction '{"without": null, "compact": {"pass": "compact", "optimizer_states": 2},
    "all": {"optimizer_states": 2}}' 40 $FLAGS $FP8 --n_layers=32
}

fp8_32_budget() {  # a budget 3 GB under the base's peak, beside fp8_32 (its own base: pairs are made in a process)
  paired paired_fp8_l32_n8_budget '{"without": null, "budget3": {"optimizer_states": 2, "policy": "budget",
    "budget_below_base_bytes": 3000000000}}' 40 $FLAGS $FP8 --n_layers=32
}

# 2026-12-02, second session: one model a run, every arm a program of it (paired.py --one-model); "old" is the pass
# as the session found it (596b2e3: carry .rev/, made by `git archive -o .rev/596b2e3.tar 596b2e3 thunder_fp8shard`)
OLD='"old": {"optimizer_states": 2, "revision": "596b2e3"}'

fp8_8_one_model() {  # s3: the one-model runs checked on the device, and the operators' costs profiled
  mkdir -p "$R/traces"
  paired paired_fp8_l8_n8_one_model "{\"without\": null, \"null\": null, $OLD, \"default\": {\"optimizer_states\": 2},
    \"compact\": {\"pass\": \"compact\", \"optimizer_states\": 2},
    \"budget0.5\": {\"optimizer_states\": 2, \"policy\": \"budget\", \"budget_below_base_bytes\": 500000000}}" 20 \
    --one-model --profile --profile-arms without,old,default --trace-dir "$R/traces" -- $FLAGS $FP8 --n_layers=8
}

B='"optimizer_states": 2, "policy": "budget", "budget_below_base_bytes"'

fp8_32_curve() {  # s4: the trade-off curve from one run, the default against the pass as found, profiled
  mkdir -p "$R/traces"
  paired paired_fp8_l32_n8_curve "{\"without\": null, \"null\": null, $OLD, \"default\": {\"optimizer_states\": 2},
    \"compact\": {\"pass\": \"compact\", \"optimizer_states\": 2}, \"budget1\": {$B: 1000000000},
    \"budget2\": {$B: 2000000000}, \"budget4\": {$B: 4000000000}, \"budget6\": {$B: 6000000000}}" 40 \
    --one-model --profile --profile-arms without,old,default --trace-dir "$R/traces" -- $FLAGS $FP8 --n_layers=32
  touch "$R/busy/fp8_32_again" && (JOB=fp8_32_again; fp8_32_again)  # its second launch, once this one's memory is free
}

fp8_32_again() {  # s4: the default's second launch (item 4 asks two), and the FP8 forward all-gather (issue #32)
  paired paired_fp8_l32_n8_again '{"without": null, "null": null, "default": {"optimizer_states": 2},
    "fwdgather": {"optimizer_states": 2, "fp8_forward_gather": true}}' 40 \
    --one-model -- $FLAGS $FP8 --n_layers=32
}

bf16_32_curve() {  # s4: bf16's curve from one run
  paired paired_bf16_l32_n8_curve "{\"without\": null, \"null\": null,
    \"compact\": {\"pass\": \"compact\", \"optimizer_states\": 2}, \"budget4\": {\"candidates\": \"all\", $B: 4000000000},
    \"budget8\": {\"candidates\": \"all\", $B: 8000000000}, \"all\": {\"candidates\": \"all\", \"optimizer_states\": 2}}" 40 \
    --one-model -- $FLAGS --n_layers=32
}

# third session of 2026-12-02
bf16_32_again() {  # s5: bf16 "all"'s second launch (issue #31 item 4 asks two)
  paired paired_bf16_l32_n8_again '{"without": null, "null": null, "all": {"candidates": "all", "optimizer_states": 2}}' 40 \
    --one-model -- $FLAGS --n_layers=32
}

FWD='{"without": null, "null": null, "default": {"optimizer_states": 2, "fp8_forward_gather": false},
  "fwdgather": {"optimizer_states": 2, "fp8_forward_gather": true}}'

fp8_32_fwd() {  # s6: the default with and without the FP8 forward all-gather of two operators (issue #32), profiled
  mkdir -p "$R/traces"
  paired paired_fp8_l32_n8_fwd "$FWD" 40 --one-model --profile --profile-arms without,default,fwdgather \
    --trace-dir "$R/traces" -- $FLAGS $FP8 --n_layers=32
  touch "$R/busy/fp8_32_fwd_again" && (JOB=fp8_32_fwd_again; fp8_32_fwd_again)  # the second launch, once this one is done
}

fp8_32_fwd_again() {
  paired paired_fp8_l32_n8_fwd_again "$FWD" 40 --one-model -- $FLAGS $FP8 --n_layers=32
}

models_8() {  # s6: more model families, 8 layers (issue #33 item 6): tests/test_models_gpu.py, one model at a time
  mkdir -p "$R/models"
  OUT="$R/models" python3 -m pytest -q tests/test_models_gpu.py -p no:cacheprovider -s --durations=5 \
    > "$R/logs/test_models_gpu.log" 2>&1
  echo "models_8 rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}

ckpt_accuracy_8() {  # s6: where the checkpointed plan's +3.3% comes from (issue #33 item 3; Llama-2-7b, 8 layers, TE FP8,
  # sdpa, rank 0 of 8 simulated): the measured peak's frames and line of Thunder's program against the plan's step
  mkdir -p "$R/ckpt"
  for arm in default all; do
    opts='{}'; [ $arm = all ] && opts='{"candidates": "all"}'
    python3 benchmarks/plan_accuracy.py --backend fake --world-size 8 --n-layer 8 --seq-len 4096 --sdpa \
      --checkpoint-activations --options "$opts" --out "$R/ckpt/plan_accuracy_ckpt_l8_n8_$arm.json" \
      > "$R/logs/ckpt_accuracy_$arm.log" 2>&1
    echo "ckpt_accuracy_$arm rc=$?" >> "$R/logs/done"
  done
  rm -f "$R/busy/$JOB"
}

# fourth session of 2026-12-02
memory_arms() {  # name, arms, flags...: a few iterations an arm, one model, not timed alone (their times are no evidence)
  local name=$1 arms=$2; shift 2
  python3 benchmarks/paired.py --simulate 8 --timed 4 --warmup-quads 1 --one-model --arms "$arms" \
    --out "$R/paired/$name" -- "$@" > "$R/logs/$name.log" 2>&1
  echo "$name rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}

ckpt_fp8_32() {  # s7: Thunder's benchmark with --checkpoint_activations=True, 32 layers, FP8 (issue #33 item 3)
  memory_arms ckpt_fp8_l32_n8 '{"without": null, "default": {"optimizer_states": 2},
    "all": {"optimizer_states": 2, "candidates": "all"}}' $FLAGS $FP8 --n_layers=32 --checkpoint_activations=True
}

ckpt_bf16_32() {  # s7: the same in bf16
  memory_arms ckpt_bf16_l32_n8 '{"without": null, "all": {"optimizer_states": 2, "candidates": "all"}}' \
    $FLAGS --n_layers=32 --checkpoint_activations=True
}

fp8_32_memory() {  # s9: the default's predicted and measured peaks at 32 layers, FP8, with and without the forward gather
  memory_arms fp8_l32_n8_memory '{"without": null, "default": {"optimizer_states": 2},
    "bf16gather": {"optimizer_states": 2, "fp8_forward_gather": false}}' $FLAGS $FP8 --n_layers=32
}

RESCHED='{"without": null, "all": {"optimizer_states": 2, "candidates": "all"},
  "resched": {"optimizer_states": 2, "candidates": "all", "reschedule": true}}'

ckpt_resched() {  # s10: reschedule under --checkpoint_activations=True: layers, then precision flags (memory only)
  local n=$1; shift
  memory_arms "ckpt_resched_$1_l${n}_n8" "$RESCHED" $FLAGS ${2:-} --n_layers=$n --checkpoint_activations=True
}

ckpt_resched_8() { ckpt_resched 8 fp8 "$FP8"; touch "$R/busy/$JOB"; ckpt_resched 8 bf16; }
ckpt_resched_32_fp8() { ckpt_resched 32 fp8 "$FP8"; }
ckpt_resched_32_bf16() { ckpt_resched 32 bf16; }

ckpt_resched_chain() {  # s11: the 32-layer checkpointed runs one after the other (memory: beside bf16_32_own), then 8
  ckpt_resched 32 fp8 "$FP8"; touch "$R/busy/$JOB"; ckpt_resched 32 bf16; touch "$R/busy/$JOB"
  ckpt_resched 8 fp8 "$FP8"; touch "$R/busy/$JOB"; ckpt_resched 8 bf16
}

bf16_32_own() {  # s11: bf16 "all" with the gathered weights' shards their parameters' own (issue #31 item 4's bf16 arm)
  paired paired_bf16_l32_n8_own '{"without": null, "null": null, "all": {"candidates": "all", "optimizer_states": 2}}' 40 \
    --one-model -- $FLAGS --n_layers=32
}

# 2026-12-03, third session: may reschedule be on by default? Timed, one model, against the same pass without it
RESCHED_DEFAULT='{"without": null, "null": null, "default": {"optimizer_states": 2},
  "resched": {"optimizer_states": 2, "reschedule": true}}'

resched_fp8_32() {  # s13: FP8, 32 layers, no checkpointing: the default with and without reschedule (timed alone)
  paired resched_fp8_l32_n8 "$RESCHED_DEFAULT" 40 --one-model -- $FLAGS $FP8 --n_layers=32
}

resched_ckpt_then_bf16_32() {  # s13: checkpointed FP8 "all" with and without reschedule (timed), then bf16 "all" the same
  paired resched_ckpt_fp8_l32_n8 '{"without": null, "null": null, "all": {"optimizer_states": 2, "candidates": "all"},
    "resched": {"optimizer_states": 2, "candidates": "all", "reschedule": true}}' 40 --one-model -- \
    $FLAGS $FP8 --n_layers=32 --checkpoint_activations=True
  touch "$R/busy/$JOB"
  paired resched_bf16_l32_n8 '{"without": null, "all": {"optimizer_states": 2, "candidates": "all"},
    "resched": {"optimizer_states": 2, "candidates": "all", "reschedule": true}}' 40 --one-model -- $FLAGS --n_layers=32
}

# 2026-12-03, fourth session: where the default's CPU goes (issue #43), with every collective one kernel
te_cost() {  # s14: CPU microseconds a call of the operations around a TE FP8 weight, fake group and one kernel
  for mode in fake onekernel; do
    flag=""; [ $mode = onekernel ] && flag="--one-kernel"
    PYTHONPATH=benchmarks:$PYTHONPATH python3 benchmarks/te_call_cost.py $flag --out "$R/te_cost_$mode.json" \
      > "$R/logs/te_cost_$mode.log" 2>&1
  done
  echo "te_cost rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}
decompose_8() {  # s14: the pass's CPU a step by operator (--decompose-iters), the old pass (1d0abc3) and this one
  python3 benchmarks/paired.py --simulate 8 --one-model --timed 20 --decompose-iters 5 --arms '{"without": null,
    "null": null, "old": {"optimizer_states": 2, "revision": "1d0abc3"}, "default": {"optimizer_states": 2}}' \
    --out "$R/paired/decompose_fp8_l8_n8" -- $FLAGS $FP8 --n_layers=8 > "$R/logs/decompose_fp8_l8_n8.log" 2>&1
  echo "decompose_8 rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}
te_cost_then_decompose_2() {  # s15: the TE calls' CPU alone, then the default with and without the FP8 forward
  # gather at 2 layers, every collective one kernel, the operators' thread CPU time (no other job on the device)
  for mode in fake onekernel; do
    flag=""; [ $mode = onekernel ] && flag="--one-kernel"
    PYTHONPATH=benchmarks:$PYTHONPATH python3 benchmarks/te_call_cost.py --repeat 100 $flag \
      --out "$R/te_cost_$mode.json" > "$R/logs/te_cost_$mode.log" 2>&1
  done
  python3 benchmarks/paired.py --simulate 8 --one-model --timed 12 --decompose-iters 8 --arms '{"without": null,
    "null": null, "default": {"optimizer_states": 2}, "nofwd": {"optimizer_states": 2, "fp8_forward_gather": false}}' \
    --out "$R/paired/decompose_fp8_l2_n8" -- $FLAGS $FP8 --n_layers=2 > "$R/logs/decompose_fp8_l2_n8.log" 2>&1
  echo "te_cost_then_decompose_2 rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}
# 2026-12-03, fourth session, the last sitting: the final code. Builds in two waves by device memory (FP8 46 GB, bf16
# 64 GB, checkpointed 21 and 32 GB at their peaks), then every timed run alone
DEFAULT_ARMS='{"without": null, "null": null, "default": {"optimizer_states": 2}}'
fp8_a() {  # s16: the FP8 default, 32 layers, first launch; and the FP8 forward gather on (its cost, one kernel)
  paired final_fp8_l32_n8_a '{"without": null, "null": null, "default": {"optimizer_states": 2},
    "fwdgather": {"optimizer_states": 2, "fp8_forward_gather": true}}' 40 --one-model -- $FLAGS $FP8 --n_layers=32
}
fp8_b() { paired final_fp8_l32_n8_b "$DEFAULT_ARMS" 40 --one-model -- $FLAGS $FP8 --n_layers=32; }
ckpt_fp8_mem() { memory_arms final_ckpt_fp8_l32_n8 '{"without": null, "default": {"optimizer_states": 2}}' \
  $FLAGS $FP8 --n_layers=32 --checkpoint_activations=True; }
wave_one_built() {  # the second wave's builds wait for the first's (their device memory)
  while [ -e "$R/busy/fp8_a" ] || [ -e "$R/busy/fp8_b" ] || [ -e "$R/busy/ckpt_fp8_mem" ]; do sleep 5; done
}
bf16_a() { wave_one_built; paired final_bf16_l32_n8 "$DEFAULT_ARMS" 40 --one-model -- $FLAGS --n_layers=32; }
ckpt_bf16_mem() { wave_one_built; memory_arms final_ckpt_bf16_l32_n8 '{"without": null,
  "default": {"optimizer_states": 2}}' $FLAGS --n_layers=32 --checkpoint_activations=True; }
gpu_tests() {
  mkdir -p "$R/gpu"
  OUT="$R/gpu" python3 -m pytest -q tests/test_te_gpu.py tests/test_multicopy.py -k "not nccl" -n ${GPU_TEST_WORKERS:-1} -p no:cacheprovider -s --durations=20 \
    > "$R/logs/test_te_gpu.log" 2>&1
  echo "gpu_tests rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}

# 2026-12-03, fifth session: where the default's CPU a step goes outside the pass's operators (issue #43): every
# function's own time under cProfile, and one profiled iteration, at 8 layers (not timed alone: no evidence of time)
cprof() {  # name, flags...
  local name=$1; shift
  mkdir -p "$R/traces/$name"
  python3 benchmarks/paired.py --simulate 8 --one-model --timed 8 --warmup-quads 1 --decompose-iters 3 --cprofile 3 \
    --profile --profile-arms without,default --trace-dir "$R/traces/$name" --arms "$DEFAULT_ARMS" \
    --out "$R/paired/$name" -- "$@" > "$R/logs/$name.log" 2>&1
  echo "$name rc=$?" >> "$R/logs/done"
  rm -f "$R/busy/$JOB"
}
cprof_fp8_8() { cprof cprof_fp8_l8_n8 $FLAGS $FP8 --n_layers=8; }
cprof_bf16_8() { cprof cprof_bf16_l8_n8 $FLAGS --n_layers=8; }

# 2026-12-04: the FP8 default at 32 layers since the all-gather render is one vectorized cat (505c8a4), two launches
# timed one after the other; the first also profiles one iteration of each arm (GPU kernels by category)
fp8_c() {
  mkdir -p "$R/traces/final_fp8_l32_n8_c"
  paired final_fp8_l32_n8_c "$DEFAULT_ARMS" 40 --one-model --profile --profile-arms without,default \
    --trace-dir "$R/traces/final_fp8_l32_n8_c" -- $FLAGS $FP8 --n_layers=32
}
fp8_d() { paired final_fp8_l32_n8_d "$DEFAULT_ARMS" 40 --one-model -- $FLAGS $FP8 --n_layers=32; }
fp8_e() { paired final_fp8_l32_n8_e "$DEFAULT_ARMS" 40 --one-model -- $FLAGS $FP8 --n_layers=32; }
bf16_b() { paired final_bf16_l32_n8_b "$DEFAULT_ARMS" 40 --one-model -- $FLAGS --n_layers=32; }

# 2026-12-04, second session: the checkpointed defaults timed (issue #45 item 3) and bf16's third launch (wave one,
# 21 + 32 + 64 GB), then the FP8 default with the pass's gathers on a stream of their own (--comm-stream, with the
# vectorized render): how much of the backward's render the compute stream pays where NCCL's stream would not
ckpt_fp8_t() { paired final_ckpt_fp8_l32_n8_t "$DEFAULT_ARMS" 40 --one-model -- $FLAGS $FP8 --n_layers=32 \
  --checkpoint_activations=True; }
ckpt_bf16_t() { paired final_ckpt_bf16_l32_n8_t "$DEFAULT_ARMS" 40 --one-model -- $FLAGS --n_layers=32 \
  --checkpoint_activations=True; }
bf16_d() { paired final_bf16_l32_n8_d "$DEFAULT_ARMS" 40 --one-model -- $FLAGS --n_layers=32; }
wave_s20_built() { while [ -e "$R/busy/ckpt_fp8_t" ] || [ -e "$R/busy/ckpt_bf16_t" ] || [ -e "$R/busy/bf16_d" ]; do sleep 5; done; }
fp8_stream() { wave_s20_built; paired final_fp8_l32_n8_stream "$DEFAULT_ARMS" 40 --one-model --comm-stream -- \
  $FLAGS $FP8 --n_layers=32; }
# s21 (the same session, its last device minutes): one more launch of each FP8 render, built side by side
fp8_f() { paired final_fp8_l32_n8_f "$DEFAULT_ARMS" 32 --one-model -- $FLAGS $FP8 --n_layers=32; }
fp8_stream_b() { paired final_fp8_l32_n8_stream_b "$DEFAULT_ARMS" 32 --one-model --comm-stream -- $FLAGS $FP8 \
  --n_layers=32; }
# s23 (2026-12-04, third session): the GPU module on the code after s19 (the compaction options in one function, the
# backward's TE names), beside the builds of the FP8 default's next launch and checkpointed FP8's second
fp8_g() { paired final_fp8_l32_n8_g "$DEFAULT_ARMS" 40 --one-model -- $FLAGS $FP8 --n_layers=32; }
ckpt_fp8_u() { paired final_ckpt_fp8_l32_n8_u "$DEFAULT_ARMS" 40 --one-model -- $FLAGS $FP8 --n_layers=32 \
  --checkpoint_activations=True; }

# s24 (the third session): what the FP8 default's time is made of, every arm a program of one model: the default,
# the default without compaction (compact="off") and compaction alone (CompactSavedViews), with bf16's fourth launch
fp8_parts_h() { paired final_fp8_l32_n8_h '{"without": null, "null": null, "default": {"optimizer_states": 2},
  "nocompact": {"optimizer_states": 2, "compact": "off"}, "compact": {"pass": "compact", "optimizer_states": 2}}' 40 \
  --one-model -- $FLAGS $FP8 --n_layers=32; }
bf16_e() { paired final_bf16_l32_n8_e "$DEFAULT_ARMS" 40 --one-model -- $FLAGS --n_layers=32; }

# s26 (2026-12-05): the shard op's copies in one kernel launch (runtime/multicopy.py). The GPU module and the kernel's
# tests beside the builds; the FP8 default, exactly {} as a user writes it, beside the pass as the session found it
# (0b4b687: carry .rev/, `git archive -o .rev/0b4b687.tar 0b4b687 thunder_fp8shard`); the FP8 default's next launch;
# then bf16's, built after both FP8 runs are timed (a build beside a timed run would share its CPU)
USER_ARMS='{"without": null, "null": null, "default": {}}'
fp8_i() { paired final_fp8_l32_n8_i '{"without": null, "null": null, "old": {"revision": "0b4b687"}, "default": {}}' \
  40 --one-model -- $FLAGS $FP8 --n_layers=32; }
fp8_j() {  # and one profiled iteration of each side (profile_summary.py: where the step's time goes)
  if [ -n "${S26_SEQUENTIAL:-}" ]; then  # an 80 GB card: built after fp8_i is timed (46 GB each)
    while ! grep -q "final_fp8_l32_n8_i rc=" "$R/logs/done" 2>/dev/null; do sleep 5; done
  fi
  mkdir -p "$R/traces/final_fp8_l32_n8_j"
  paired final_fp8_l32_n8_j "$USER_ARMS" 40 --one-model --profile --profile-arms without,default \
    --trace-dir "$R/traces/final_fp8_l32_n8_j" -- $FLAGS $FP8 --n_layers=32
}
bf16_f() {
  while ! grep -q "final_fp8_l32_n8_j rc=" "$R/logs/done" 2>/dev/null || ! grep -q "final_fp8_l32_n8_i rc=" "$R/logs/done" 2>/dev/null; do
    sleep 5; done
  paired final_bf16_l32_n8_f "$USER_ARMS" 40 --one-model -- $FLAGS --n_layers=32
}

# s27 (next): first `git revert 1beed4f` (the calls made again, ops._Again) and carry .rev/ with
# `git archive -o .rev/f9be2c0.tar f9be2c0 thunder_fp8shard` (one launch a shard op, without them). The GPU module on
# it beside the builds; the FP8 default beside one launch alone; the FP8 default's next launch with a profiled
# iteration; bf16's; FP8 at seq 8192 (80.6 GB without the pass: an H200 only)
fp8_k() { paired final_fp8_l32_n8_k '{"without": null, "null": null, "onelaunch": {"revision": "f9be2c0"}, "default": {}}' \
  40 --one-model -- $FLAGS $FP8 --n_layers=32; }
fp8_l() {
  while ! grep -q "final_fp8_l32_n8_k rc=" "$R/logs/done" 2>/dev/null; do sleep 5; done
  mkdir -p "$R/traces/final_fp8_l32_n8_l"
  paired final_fp8_l32_n8_l "$USER_ARMS" 40 --one-model --profile --profile-arms without,default \
    --trace-dir "$R/traces/final_fp8_l32_n8_l" -- $FLAGS $FP8 --n_layers=32
}
bf16_g() {
  while ! grep -q "final_fp8_l32_n8_l rc=" "$R/logs/done" 2>/dev/null; do sleep 5; done
  paired final_bf16_l32_n8_g "$USER_ARMS" 40 --one-model -- $FLAGS --n_layers=32
}
fp8_8192_a() {
  while ! grep -q "final_bf16_l32_n8_g rc=" "$R/logs/done" 2>/dev/null; do sleep 5; done
  paired final_fp8_l32_n8_s8192_a "$USER_ARMS" 32 --one-model -- $FLAGS $FP8 --n_layers=32 --block_size=8192
}

launch() {  # job names (the functions above): each in the background, every busy file made first, each run from a
  # private copy of the tree ($R/tree): the device tool copies the working tree again at every call, and a job
  # importing a file while the next call rewrites it fails (sitting s9: an ImportError in one pytest worker)
  local job
  rm -rf "$R/tree" && mkdir -p "$R/tree"
  tar cf - --exclude=./.git --exclude=./.dev-te --exclude=./.dev-whl --exclude=./.venv . | tar xf - -C "$R/tree"
  for job in "$@"; do touch "$R/busy/$job"; done
  for job in "$@"; do
    setsid nohup bash -c "cd '$R/tree'; export PYTHONPATH='$R/tree':\$PYTHONPATH; $(declare -f paired memory_only memory_arms cprof fp8_32_again fp8_32_fwd_again ckpt_resched wave_one_built wave_s20_built "$job"); R=$R JOB=$job FLAGS='$FLAGS' FP8='$FP8' OLD='$OLD' USER_ARMS='$USER_ARMS' B='$B' FWD='$FWD' RESCHED='$RESCHED' RESCHED_DEFAULT='$RESCHED_DEFAULT' DEFAULT_ARMS='$DEFAULT_ARMS' GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-1}; $job" \
      > "$R/logs/chain_$job.log" 2>&1 &
  done
}

case "${1:-}" in
  start)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/logs/device.txt" 2>&1
    case "${2:-}" in
      s1) launch gpu_tests fp8_8 bf16_8 setups_8; echo 6 > "$R/logs/expected" ;;  # setups_8: three results
      # the GPU module runs in a later call of the sitting (pytest -n 3), which removes busy/gpu_tests_later
      s2) touch "$R/busy/gpu_tests_later"; launch fp8_32 fp8_32_budget; echo 2 > "$R/logs/expected" ;;
      s3) launch fp8_8_one_model; echo 1 > "$R/logs/expected" ;;
      s4) export GPU_TEST_WORKERS=6; launch gpu_tests fp8_32_curve bf16_32_curve; echo 4 > "$R/logs/expected" ;;
      s5) export GPU_TEST_WORKERS=6; launch gpu_tests bf16_32_again; echo 2 > "$R/logs/expected" ;;
      s6) export GPU_TEST_WORKERS=6; launch gpu_tests models_8 ckpt_accuracy_8 fp8_32_fwd; echo 6 > "$R/logs/expected" ;;
      s7) export GPU_TEST_WORKERS=6; launch gpu_tests ckpt_fp8_32 ckpt_bf16_32; echo 3 > "$R/logs/expected" ;;
      # 2026-12-03: the GPU modules on the merged plan/run report and program facts (issue #34 item 6)
      s8) export GPU_TEST_WORKERS=6; launch gpu_tests models_8; echo 2 > "$R/logs/expected" ;;
      # the memory model counting the FP8 forward gathers' 1 B/element buffers: the GPU modules and the headline's
      # memory (32 layers, FP8: the default's prediction against the device, a few iterations, not timed alone)
      s9) export GPU_TEST_WORKERS=6; launch gpu_tests models_8 fp8_32_memory; echo 3 > "$R/logs/expected" ;;
      # reschedule (off by default, measured on the CPU only) under activation checkpointing, and the GPU module whole
      s10) export GPU_TEST_WORKERS=6; launch gpu_tests ckpt_resched_8 ckpt_resched_32_fp8 ckpt_resched_32_bf16; echo 5 > "$R/logs/expected" ;;
      # 2026-12-03, second session: s10's runs with own shards (a gathered weight's shard is its parameter's), the
      # bf16 "all" paired run with them, and the GPU module
      s11) export GPU_TEST_WORKERS=6; launch gpu_tests ckpt_resched_chain bf16_32_own; echo 6 > "$R/logs/expected" ;;
      # s11's machine went back before its last runs were collected: those two again
      s12) launch ckpt_resched_32_bf16 bf16_32_own; echo 2 > "$R/logs/expected" ;;
      # 2026-12-03, third session: reschedule timed (on by default?) and the GPU module on the final pass
      s13) export GPU_TEST_WORKERS=6; launch gpu_tests resched_fp8_32 resched_ckpt_then_bf16_32; echo 4 > "$R/logs/expected" ;;
      # 2026-12-03, fourth session: the GPU module on the layouts (issue #44), the TE calls' CPU, the decomposition
      s14) export GPU_TEST_WORKERS=12; launch gpu_tests te_cost decompose_8; echo 3 > "$R/logs/expected" ;;
      s15) launch te_cost_then_decompose_2; echo 1 > "$R/logs/expected" ;;
      s16) export GPU_TEST_WORKERS=12; launch gpu_tests fp8_a fp8_b ckpt_fp8_mem bf16_a ckpt_bf16_mem
        echo 6 > "$R/logs/expected" ;;
      # 2026-12-03, fifth session: the default's CPU by Python function, FP8 and bf16, 8 layers; the TE calls' CPU
      s17) launch cprof_fp8_8 cprof_bf16_8 te_cost; echo 3 > "$R/logs/expected" ;;
      # 2026-12-04: the FP8 default's time at 32 layers with the vectorized render, two launches
      s18) launch fp8_c fp8_d; echo 2 > "$R/logs/expected" ;;
      # the final code: the GPU module beside the builds, then the FP8 default's third launch and bf16's, timed alone
      s19) export GPU_TEST_WORKERS=12; launch gpu_tests fp8_e bf16_b; echo 3 > "$R/logs/expected" ;;
      # 2026-12-04, second session: see above (ckpt_fp8_t)
      s20) launch ckpt_fp8_t ckpt_bf16_t bf16_d fp8_stream; echo 4 > "$R/logs/expected" ;;
      s21) launch fp8_f fp8_stream_b; echo 2 > "$R/logs/expected" ;;
      s23) export GPU_TEST_WORKERS=12; launch gpu_tests fp8_g ckpt_fp8_u; echo 3 > "$R/logs/expected" ;;
      s24) launch fp8_parts_h bf16_e; echo 2 > "$R/logs/expected" ;;
      # bf16_f builds after both FP8 runs are timed; on an 80 GB card (an H100) the two FP8 runs build one after the
      # other and bf16 is left out (the sitting would outlast the machine)
      s26) export GPU_TEST_WORKERS=12
        if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
          export S26_SEQUENTIAL=1; launch gpu_tests fp8_i fp8_j; rm -f "$R/busy/fp8_j"; echo 3 > "$R/logs/expected"
        else
          launch gpu_tests fp8_i fp8_j bf16_f; rm -f "$R/busy/bf16_f"; echo 4 > "$R/logs/expected"
        fi ;;
      # one after another after the first build (each waits for the one before it to finish)
      s27) export GPU_TEST_WORKERS=12; launch gpu_tests fp8_k fp8_l bf16_g fp8_8192_a
        rm -f "$R/busy/fp8_l" "$R/busy/bf16_g" "$R/busy/fp8_8192_a"; echo 5 > "$R/logs/expected" ;;
      *) echo "usage: $0 start s1|...|s27"; exit 2 ;;
    esac
    echo started ;;
  collect)
    want=$(cat "$R/logs/expected")
    end=$((SECONDS + ${WAIT:-540}))
    while [ $SECONDS -lt $end ] && [ "$(grep -c rc= "$R/logs/done" 2>/dev/null || echo 0)" -lt "$want" ]; do sleep 5; done
    cat "$R/logs/done" 2>/dev/null; ls "$R/busy"
    grep -h "\[paired\]" "$R"/logs/*.log | cut -c1-200
    tail -n 2 "$R"/logs/*.log | cut -c1-300
    nvidia-smi --query-gpu=memory.used --format=csv
    tar czf "$OUT/sitting.tgz" --exclude=./tree -C "$R" . && ls -la "$OUT" ;;
  *) echo "usage: $0 start s1|s2|collect"; exit 2 ;;
esac
