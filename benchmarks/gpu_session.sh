#!/usr/bin/env bash
# The GPU checks of one lent-machine session, each part under its own time limit, so that one part failing or
# running long leaves the others' figures. Here first (commit, then pack: ../shared/gpu/README.md):
#     ../shared/gpu/bundle.sh . gpu --with-trl
# There, from the checkout's root with `gpu` carried (device tool: carry ["gpu"]):
#     bash benchmarks/gpu_session.sh [part ...]      parts: vs-trl graph-vs-trl throughput ours graph async1 async2
#                                                    thread1 graph-thread1 logits static gpu-tests bf16 resume
#                                                    checks (gpu-tests and resume at once)
#                                                    (default: vs-trl throughput)
# Not measured yet on a GPU (2026-11-27), in the order to run them, one call (the device tool's timeout_s about 580
# of a session's 900 s; the parts' limits add up to 11.5 min, but whole vs-trl runs took 2.5 min on the H100 and
# H200, ours alone 2.3, and checks runs the GPU tests beside a tiny kill-and-resume):
#     bash benchmarks/gpu_session.sh graph-vs-trl ours checks
# graph against TRL and against the shared-prompt cache with every other change, the GPU tests and a GPU resume;
# then, in a second call if time is left: `graph-thread1 bf16`.
# vs-trl: benchmarks/gpu_vs_trl.py (whole rlvr run against TRL GRPOTrainer, the 0.5B shape, 64 x 8 x 256 tokens);
# throughput: benchmarks/gpu_throughput.py with the transformers engine, shared-prompt cache and graph loop (vLLM
# cannot be carried there);
# ours: the vs-trl run without TRL (the fused LM head on, its CUDA default); logits: ours with the full-logits loss
# pass (train.grpo.fused_head=false), to compare; static: ours with rollout.cache=static (compiled static KV cache;
# 200 s did not reach its steady steps on 2026-11-26: each new batch shape compiles);
# async1/async2: ours with rollouts overlapped with training (flow.async_level=1 or 2: a sampler process beside the
# trainer on the same GPU, so the per-stage peaks undercount the device's: smi.csv polls nvidia-smi's total);
# thread1: async1 with flow.sampler=thread (the sampler a thread of the run's process, on a CUDA stream of its own,
# so its kernels can run beside the trainer's rather than take turns with another process's);
# graph-vs-trl / graph / graph-thread1: vs-trl / ours / thread1 with rollout.cache=graph (our decoding loop over a
# static key/value cache, each token step replayed as a CUDA graph: trainer/graph_decoding.py);
# bf16: graph with policy.dtype=bfloat16 (bf16 weights, no float32 master copy);
# resume: benchmarks/gpu_resume.py (a tiny-model run SIGKILLed at its 4th train step and resumed, against an
# uninterrupted one, both on cuda);
# gpu-tests: the tests marked gpu (pytest -m gpu; those files only), skipped where there is no CUDA device.
# Output lands in $OUT: one .txt per part, smi.csv, and the runs' logs packed into logs.tgz after each part (the
# device tool brings back at most 8 files).
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# From /tmp: its import check runs `python3 -`, whose sys.path starts with the working directory, and the
# checkout's rlvr/ folder would shadow the installed rlvr package there.
here=$PWD
s=$(cd /tmp && bash "$here/gpu/setup-on-device.sh") && eval "$s" || exit 1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    (cd /tmp && python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)")
    date -u
} 2>&1 | tee "$OUT/gpu.txt"
# The device's memory in use and load every half second, all parts together (their start times are in gpu.txt).
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 500 >"$OUT/smi.csv" 2>&1 &
poller=$!
logs=/tmp/gpu-session-logs
mkdir -p "$logs"

# vs_trl NAME LIMIT_S ARGS...: gpu_vs_trl.py in its own temp root, its output and the runs' logs (last 2 MB) to $OUT.
vs_trl() {
    local name=$1 limit=$2
    shift 2
    local root=/tmp/bench-$name
    mkdir -p "$root"
    TMPDIR=$root timeout -k 10 "$limit" python3 benchmarks/gpu_vs_trl.py --device cuda --keep "$@" 2>&1 | tee "$OUT/$name.txt"
    for log in "$root"/rlvr-gpu-vs-trl-*/*.log; do
        [ -f "$log" ] && tail -c 2000000 "$log" >"$logs/$name-$(basename "$log")"
    done
    tar -czf "$OUT/logs.tgz" -C "$logs" .
    rm -rf "$root"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(vs-trl throughput)
for part in "${parts[@]}"; do
    echo "=== $part $(date -u +%T)" | tee -a "$OUT/gpu.txt"
    case $part in
    vs-trl) vs_trl vs_trl 330 --warmup 1 --steps 2 ;;
    throughput)
        timeout -k 10 150 python3 benchmarks/gpu_throughput.py --engines transformers graph 2>&1 | tee "$OUT/throughput.txt"
        ;;
    ours) vs_trl ours 200 --warmup 1 --steps 2 --no-trl ;;
    async1) vs_trl async1 235 --warmup 1 --steps 2 --no-trl --set flow.async_level=1 ;;
    async2) vs_trl async2 235 --warmup 1 --steps 2 --no-trl --set flow.async_level=2 ;;
    thread1) vs_trl thread1 235 --warmup 1 --steps 2 --no-trl --set flow.async_level=1 --set flow.sampler=thread ;;
    gpu-tests)
        timeout -k 10 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_device.py tests/test_grpo_memory.py tests/test_graph_decoding.py 2>&1 | tail -40 | tee "$OUT/gpu-tests.txt"
        ;;
    logits) vs_trl logits 200 --warmup 1 --steps 2 --no-trl --set train.grpo.fused_head=false ;;
    graph-vs-trl) vs_trl graph_vs_trl 330 --warmup 1 --steps 2 --set rollout.cache=graph ;;
    graph) vs_trl graph 200 --warmup 1 --steps 2 --no-trl --set rollout.cache=graph ;;
    graph-thread1)
        vs_trl graph_thread1 235 --warmup 1 --steps 2 --no-trl --set rollout.cache=graph --set flow.async_level=1 \
            --set flow.sampler=thread
        ;;
    static) vs_trl static 400 --warmup 1 --steps 2 --no-trl --set rollout.cache=static ;;
    bf16) vs_trl bf16 200 --warmup 1 --steps 2 --no-trl --set rollout.cache=graph --set policy.dtype=bfloat16 ;;
    resume) timeout -k 10 150 python3 benchmarks/gpu_resume.py --device cuda 2>&1 | tee "$OUT/resume.txt" ;;
    checks) # gpu-tests and resume side by side: neither is timed, so they may share the device
        (timeout -k 10 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_device.py \
            tests/test_grpo_memory.py tests/test_graph_decoding.py 2>&1 | tail -40 >"$OUT/gpu-tests.txt") &
        timeout -k 10 150 python3 benchmarks/gpu_resume.py --device cuda 2>&1 | tee "$OUT/resume.txt"
        wait
        cat "$OUT/gpu-tests.txt"
        ;;
    *) echo "unknown part $part" ;;
    esac
done
kill "$poller" 2>/dev/null
echo "=== done $(date -u +%T)" | tee -a "$OUT/gpu.txt"
