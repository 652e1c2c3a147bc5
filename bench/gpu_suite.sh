#!/usr/bin/env bash
# The GPU work no CI machine can do, in one script for a lent H200 (see bench/RESULTS.md).
# Usage: bash bench/gpu_suite.sh kernel-tests|tests|alone|bench|sharing|sharing-alone|sweep|peers-4k|peers-long|scaling|multi|profile|profile-2b|ncu|pattern [...]; logs go to $OUT (or ./gpu-out).
set -u -o pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# (The device copy's .git is the session's first commit: never `git stash` or `git checkout` there.)
for stage in "$@"; do
  case $stage in
    tests)
      nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
      python3 -c 'import os, pynvml, torch; torch.ones(1, device="cuda"); pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); print("own pid", os.getpid(), "NVML pids", [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)])'
      python3 -m pytest -q -p no:cacheprovider --timeout 300 -rfE --durations=8 -m cuda tests/engine/training/test_trainer_cuda.py \
        tests/engine/models/test_models_ns_pool_read.py tests/engine/models/test_models_ns_model.py tests/engine/models/test_models_pssa.py \
        tests/engine/models/test_models_transformer.py tests/engine/ops/test_tune.py tests/engine/training/test_validate.py tests/engine/gpu/test_gpu.py \
        2>&1 | tee "$out/tests_cuda.log"
      ;;
    alone)
      # CUDA tests that train real lines: each in its own pytest process, since a pytest process that
      # already holds GPU memory trips the line's own sharing guard. Their lines compile at start: the
      # placement and dreaming tests needed more than 100 s each in session 12 (the default is 300).
      for selection in tests/engine/gpu/test_gpu_placement_cuda.py tests/engine/training/test_distributed_cuda.py \
          "tests/engine/training/test_dreaming.py -k cuda" "tests/engine/models/test_memory_budget.py -k cuda" \
          "tests/engine/models/test_models_pssa.py -m cuda" "tests/engine/models/test_models_ns_model.py -k kernel"; do
        echo "== $selection"
        timeout ${ALONE_TIMEOUT:-300} python3 -m pytest -v -p no:cacheprovider -rfE $selection 2>&1 | tail -40
      done 2>&1 | tee -a "$out/tests_alone.log"
      ;;
    kernel-tests)
      # test_sass_report.py compiles the shipped tiles with this machine's Triton (layouts differ by version).
      python3 -m pytest -q -p no:cacheprovider --timeout 300 -rfE tests/kernels/ \
        2>&1 | tee "$out/tests_kernels.log"
      ;;
    bench)
      # The training core's comparison (issue 6): eager against CUDA graphs at 4K.
      for run in "ns-1p3b 1 8 none" "ns-1p3b 4 2 dendritic" "pssa-127m 4 2 none"; do
        set -- $run
        for engine in eager graph; do
          timeout 200 python3 -m nsconsole bench --model $1 --seq-len 4096 --rows $2 --accum $3 \
            --recompute $4 --engine $engine 2>&1 | grep -E '^\{|Error' | cut -c1-400
        done
      done 2>&1 | tee "$out/train_bench.log"
      # The NS models' compiled dendritic scan against the eager one, and the 2B model (session 8).
      for run in "ns-1p3b compile_scan=false" "ns-2b compile_scan=true"; do
        set -- $run
        timeout 200 python3 -m nsconsole bench --model $1 --seq-len 4096 --rows 4 --accum 2 \
          --recompute dendritic --engine graph --override $2 2>&1 | grep -E '^\{|Error' | cut -c1-400
      done 2>&1 | tee -a "$out/train_bench.log"
      timeout 120 python3 bench/ns_layers.py --only pool_read layers model 2>&1 | grep '^{' | tee "$out/ns_layers.log"
      timeout 240 python3 bench/kernels.py --out "$out/kernels.jsonl" > "$out/kernels.log" 2>&1
      tail -30 "$out/kernels.log"
      ;;
    sharing|sharing-alone)
      # One phase a stage (each takes minutes): `sharing` with a reserve, `sharing-alone` without.
      phase=$([ "$stage" = sharing ] && echo shared || echo alone)
      timeout 450 python3 bench/gpu_sharing.py --work /tmp/gpu-sharing --phases $phase 2>&1 | grep '^{' \
        | tee "$out/sharing_$phase.log"
      cp /tmp/gpu-sharing/$phase/run.log "$out/${phase}_run.log" 2>/dev/null
      ;;
    sweep)
      # Issue 5: the scans' block, chunk and pipeline-depth variants side by side, each checked first.
      timeout 400 python3 bench/kernels.py --sweep --only scan plif --out "$out/sweep.jsonl" 2>&1 | grep '^{' \
        | tee "$out/sweep.log"
      ;;
    profile)
      # Where the main model's update goes (MFU 0.13 at 4K in session 3): the top kernels of one update.
      timeout 240 python3 -m nsconsole bench --model ns-1p3b --seq-len 4096 --rows 4 --accum 2 \
        --recompute dendritic --engine eager --profile 2>&1 | grep -E '^\{|Error' | tee "$out/profile_ns1p3b.log"
      ;;
    peers-4k)
      # Issue 22's headline row: ns-2b at 4K beside the plain compiled GPT, at each recomputation in
      # $RECOMPUTES (none first: 28,119 tok/s, MFU 0.541 at 8 x 1 on the H200 in session 28, not yet
      # beside the GPT; no dendritic:K row has run on an H200 yet); the GPT once.
      models=plain-gpt,ns-2b
      for recompute in ${RECOMPUTES:-none dendritic:18 dendritic}; do
        python3 bench/gpu_peers.py --seq-lens 4096 --models $models --recompute $recompute --updates 5 --warmup 2 \
          --out "$out/peers.jsonl" 2>&1 | grep -v '^{'
        models=ns-2b
      done 2>&1 | tee -a "$out/peers.log"
      ;;
    peers-long)
      # Issue 22: ns-2b against transformer-2b at 16K and 32K ($RECOMPUTE for ns-2b; $ATTENTION
      # default or cudnn for the transformer's SDPA, the stronger yardstick).
      python3 bench/gpu_peers.py --seq-lens 16384,32768 --models transformer-2b,ns-2b --recompute ${RECOMPUTE:-dendritic} \
        --attention ${ATTENTION:-default} --updates 4 --warmup 2 --out "$out/peers.jsonl" 2>&1 | grep -v '^{' \
        | tee -a "$out/peers.log"
      ;;
    scaling)
      # Issue 24 (a multi-GPU host): tokens/s per GPU at 4K from 1 GPU to every one visible (1, 2, 4, 8),
      # shard none and fsdp, and the scaling efficiency per doubling (goal 0.9).
      python3 bench/gpu_scaling.py --models ${MODELS:-ns-1p3b,ns-2b} --seq-len 4096 --rows ${ROWS:-4} \
        --accum ${ACCUM:-2} --recompute ${RECOMPUTE:-dendritic} --out "$out/scaling.jsonl" 2>&1 | grep -v '^{' \
        | tee "$out/scaling.log"
      ;;
    multi)
      # Issue 24 (2+ GPUs of one host): two lines on two GPUs with the console, a rank SIGKILLed on its
      # GPU, a degree-2 checkpoint resumed at degree 1; in its own pytest process (no CUDA context of
      # the test process on a GPU). The console test needs textual's wheels carried (see its skip reason).
      timeout ${MULTI_TIMEOUT:-560} python3 -m pytest -v -p no:cacheprovider -rfEs --durations=5 \
        tests/engine/gpu/test_multi_gpu_cuda.py ${MULTI_SELECT:+-k "$MULTI_SELECT"} 2>&1 | tail -60 \
        | tee "$out/tests_multi.log"
      ;;
    profile-2b)
      # Issue 22: where ns-2b's update at 4K goes, by kernel and kind, under the graph engine (session
      # 28 on the H200: 638 ms at 4 x 4K, matrix products 45 %). SEQ_LEN=32768 ROWS=1 profiles a
      # long-context update; RECOMPUTE picks the recomputation; ENGINE=eager OPS=40 names the
      # operators that launched the kernels.
      timeout ${PROFILE_TIMEOUT:-300} python3 bench/profile_update.py --model ns-2b --seq-len ${SEQ_LEN:-4096} \
        --rows ${ROWS:-4} --recompute ${RECOMPUTE:-dendritic} --engine ${ENGINE:-graph} --ops ${OPS:-0} \
        --out "$out/profile_ns2b_${SEQ_LEN:-4096}.jsonl" 2>&1 | grep -E '"(kind|summary|operator)"|Error'
      ;;
    ncu)
      # Issue 5: the scans' hardware counters (Nsight Compute; works on the Firecracker H200).
      timeout 300 ncu --clock-control none -k 'regex:plif|selective_scan' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats --metrics 'dram__bytes_read.sum,dram__bytes_write.sum,regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
        python3 bench/profile_scans.py > "$out/ncu_scans.txt" 2>&1
      grep -E '^  [_a-z].*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Issued Warp|No Eligible|Registers Per|Warp Cycles Per Issued|dram__bytes|stalled_(long|short|wait|barrier|math|mio|lg_|no_inst|not_sel|selected|drain|branch|dispatch|membar|sleep|tex|imc)' "$out/ncu_scans.txt" | head -200
      ;;
    pattern)
      # Issue 5: the scans' access pattern with no arithmetic (the ceiling it sets).
      timeout 200 python3 bench/stream_pattern.py 2>&1 | tee "$out/pattern.log"
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
