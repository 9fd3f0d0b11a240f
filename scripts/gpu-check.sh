#!/usr/bin/env bash
# Everything neorec checks and measures on a GPU, in one command that fits a short lease on a machine
# with one NVIDIA GPU, a CUDA build of torch and Triton, and no network (nothing is installed):
#
#   OUT=/some/folder bash scripts/gpu-check.sh            # all steps
#   OUT=/some/folder bash scripts/gpu-check.sh tests kaggle   # only the named steps
#
# Steps (each under its own time limit, its log in $OUT/<step>.log, its rc in $OUT/summary.txt):
#   env      versions, the GPU, the imports neorec needs
#   tests    the tests that need a GPU (they skip elsewhere): kernels against float64, training on
#            CUDA, the device data feed
#   kernels  the kernel tests alone (Triton kernels and the fused engine on CUDA against float64)
#   cachetests  the GPU row cache's GPU tests: bitwise against tables in GPU memory, syncs counted
#   ranktests  ranks sharing the GPU over gloo against one GPU process (every sharding kind, cache,
#            checkpoints across world sizes and devices, pipeline on/off)
#   gputests  (not among the defaults) tests, cachetests and ranktests at once, spread over the host's
#            cores by pytest-xdist (JOBS processes, default 8): the shortest way to run every GPU test
#   bounds   (not among the defaults) benchmarks/bounds_check.py on the GPU at batch 16,384: the id check's cost per step
#   sources  (not among the defaults) benchmarks/data_sources.py: criteo_kaggle at batch 16,384 from
#            .npy shards and Parquet files on local disk against data drawn on the GPU (samples/s, data
#            wait per step; SOURCES_REPEATS rounds, default 2)
#   profile  benchmarks/gpu_step_profile.py on criteo_kaggle at batch 16,384 and mlperf_dcnv2 (bf16):
#            the feed alone, step time, every host sync site, the top kernels and operators
#   feedprofile  (not among the defaults) benchmarks/gpu_step_profile.py on criteo_kaggle at batch 16,384
#            with data drawn on the GPU and read from .npy shards (SOURCES_DIR, written if missing): step time
#            and the training thread's CPU time a step (what it spent not running: the GIL, data, the GPU)
#   kaggle   criteo_kaggle at batch 16,384 on the GPU: samples/s and data wait per step
#   kaggle_bf16  the same with bf16 dense math
#   kaggle_compile  the same with train.compile (the dense stages through torch.compile)
#   dcnv2    mlperf_dcnv2 at batch 16,384 with bf16 dense math: samples/s
#   ranks    criteo_kaggle at batch 16,384 with 2 ranks sharing the GPU over gloo, against one rank
#   ops      benchmarks/embedding_ops_gpu.py (kernels against the device copy bandwidth, SGD, row-wise
#            AdaGrad and Adam), with each implementation's kernels by device time
#   stages   (not among the defaults) benchmarks/embedding_stages.py at 8x the CPU batches: each stage of the
#            engine's step (sort, partial sums, update, ...) by host and device time, against its bytes
#   warm     (not among the defaults) criteo_kaggle at batch 16,384 for 244 steps (4M samples) twice with
#            train.kernel_cache in a fresh folder (KERNEL_CACHE): the second run's whole-run rate against its
#            steady one is the start-up a run pays once its kernels are compiled
#   ab       (not among the defaults) the Triton kernels of an earlier tree (BEFORE: a folder with its neorec/ and
#            benchmarks/, from `git archive REV neorec benchmarks | tar -x -C DIR`; .ab-before is git-ignored,
#            so carry it to the GPU machine as .whl is) and this tree's, in turn,
#            AB_ROUNDS rounds (default 2) of benchmarks/embedding_ops_gpu.py at 8x the CPU batches: a kernel change before and after
#   cache    benchmarks/cache.py --device cuda --tier dram (GPU cache over host memory), misses read
#            ahead on the worker (io thread on) against brought in at the lookup (off), then where
#            each one's step time goes (host syncs by site, operators by host and device time); timed
#            after CACHE_WARMUP steps (default 300: after 10 the misses are mostly first reads)
#   cache_ssd  the same with --tier ssd (GPU cache over SSD files, in $SSD_DIR or /tmp/neorec-ssd)
#   ingestion  (not among the defaults) benchmarks/ingestion.py: Criteo TSV preprocessing with 1 and
#            2 workers on this host's cores, where the workers do not share 2 cores with the rest
# Packages the machine lacks (pydantic, tqdm) come from .whl/site when it is there: build it here with
# `bash scripts/gpu-wheels.sh 3.12` (the other machine's Python) and copy it along with the tree.
# The figures go to $OUT/gpu-results.jsonl (records, as benchmarks/records/ holds them);
# append what holds to benchmarks/records/embedding_ops_gpu.jsonl and run benchmarks/render_results.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/neorec-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ -d .whl/site ] && export PYTHONPATH=$PWD/.whl/site:$PYTHONPATH
PY=${PYTHON:-python3}
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env tests cachetests ranktests profile kaggle kaggle_bf16 kaggle_compile dcnv2 ranks ops cache cache_ssd)
COMMON=(--set train.progress=false --set logging.plot=false --set logging.tensorboard=false --set train.eval_every=null)

run() {  # run NAME SECONDS COMMAND...: the command's output to $OUT/NAME.log, its tail on the console
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    tail -n 12 "$OUT/$name.log"
}

summary() {  # summary RUN_FOLDER: the figures of a training run's summary.json, and its steady rate
    $PY - "$1" <<'PY'
import json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
s = json.loads((run / "summary.json").read_text())
keys = ["steps", "processes", "samples_per_s", "data_wait_ms_per_step", "train_seconds", "device_peak_mib_per_rank"]
lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
train = [x for x in lines if x.get("split") == "train"][1:]  # first: start-up
steady = {k: round(statistics.median(x[k] for x in train), 1) for k in ("samples_per_s", "data_wait_ms") if train}
print(run.name, {k: s.get(k) for k in keys}, "steady (median of logged windows after the first):", steady)
PY
}

kaggle_run() {  # kaggle_run NAME SECONDS [--set ...]: criteo_kaggle at batch 16,384 on the GPU, then its summary
    local name=$1 limit=$2
    shift 2
    run "$name" "$limit" $PY -m neorec train --config criteo_kaggle --set train.device=cuda \
        --set data.batch_size=16384 --set train.max_steps=400 --set train.log_every=20 "$@" "${COMMON[@]}" \
        --output-dir "$OUT/$name"
    summary "$OUT/$name" | tee -a "$OUT/summary.txt"
}

for step in "${STEPS[@]}"; do
    case $step in
    env)
        run env 120 bash -c "nvidia-smi; $PY -c 'import torch, triton, numpy, pyarrow, yaml, pydantic, tqdm; \
print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))'"
        ;;
    tests)
        run tests ${TESTS_LIMIT:-300} $PY -m pytest -q -rfE --durations 10 -p no:cacheprovider ${PYTEST_ARGS:-} tests/test_fused_cuda.py tests/test_train_cuda.py \
            tests/test_device_feed.py tests/test_devices.py tests/test_triton_kernels.py tests/test_triton_engine.py \
            tests/test_synthetic_device.py tests/test_id_bounds.py
        ;;
    kernels)
        run kernels ${KERNELS_LIMIT:-150} $PY -m pytest -q -rfE --durations 10 -p no:cacheprovider ${PYTEST_ARGS:-} \
            tests/test_triton_kernels.py tests/test_triton_engine.py tests/test_fused_cuda.py tests/test_id_bounds.py
        ;;
    gputests)
        XDIST=(-n "${JOBS:-8}" --dist load -p no:cacheprovider -q -rfE --durations 15)
        run gputests ${TESTS_LIMIT:-240} bash -c "$PY -m pytest ${XDIST[*]} ${PYTEST_ARGS:-} tests/test_fused_cuda.py \
            tests/test_train_cuda.py tests/test_device_feed.py tests/test_devices.py tests/test_triton_kernels.py \
            tests/test_triton_engine.py tests/test_synthetic_device.py tests/test_id_bounds.py \
            tests/test_train_cuda_ranks.py & a=\$!; $PY -m pytest ${XDIST[*]} -m gpu ${PYTEST_ARGS:-} \
            tests/test_cache.py tests/test_cache_reads.py tests/test_cache_ssd.py >$OUT/gputests-cache.log 2>&1; \
            b=\$?; wait \$a; a=\$?; tail -n 15 $OUT/gputests-cache.log; echo cache tests rc=\$b; exit \$((a|b))"
        ;;
    bounds)
        run bounds ${BOUNDS_LIMIT:-90} $PY benchmarks/bounds_check.py --device cuda --batch-size 16384 --steps 20 \
            --rounds 5
        ;;
    sources)
        run sources ${SOURCES_LIMIT:-240} $PY benchmarks/data_sources.py --device cuda --batch-size 16384 --steps 240 \
            --workers 8 --repeats "${SOURCES_REPEATS:-2}" --dir "${SOURCES_DIR:-/tmp/neorec-sources}" --results "$OUT/gpu-results.jsonl"
        ;;
    cachetests)
        run cachetests ${CACHE_TESTS_LIMIT:-180} $PY -m pytest -q -rfE --durations 10 -p no:cacheprovider -m gpu \
            ${PYTEST_ARGS:-} tests/test_cache.py tests/test_cache_reads.py tests/test_cache_ssd.py
        ;;
    ranktests)
        run ranktests ${TESTS_LIMIT:-300} $PY -m pytest -q -rfE --durations 10 -p no:cacheprovider ${PYTEST_ARGS:-} tests/test_train_cuda_ranks.py
        ;;
    profile)
        run profile_kaggle ${PROFILE_LIMIT:-120} $PY benchmarks/gpu_step_profile.py --config criteo_kaggle --set data.batch_size=16384
        run profile_dcnv2 ${PROFILE_LIMIT:-120} $PY benchmarks/gpu_step_profile.py --config mlperf_dcnv2 --set data.batch_size=16384
        ;;
    feedprofile)  # the training thread with data drawn on the GPU against fed by the .npy reader
        data=${SOURCES_DIR:-/tmp/neorec-sources}/data
        [ -f "$data/manifest.json" ] || $PY -m neorec data preprocess --synthetic --config criteo_kaggle \
            --out "$data" --workers 8 --parquet-output --no-progress \
            --set data.synthetic.train_samples=4000000 --set data.synthetic.eval_samples=200000 \
            >"$OUT/feedprofile_data.log" 2>&1
        run feedprofile_drawn ${PROFILE_LIMIT:-120} $PY benchmarks/gpu_step_profile.py \
            --config criteo_kaggle --set data.batch_size=16384
        run feedprofile_npy ${PROFILE_LIMIT:-120} $PY benchmarks/gpu_step_profile.py --config criteo_kaggle \
            --set data.batch_size=16384 --set data.source=preprocessed --set data.preprocessed.path="$data"
        grep -h "^step:\|^training thread" "$OUT/feedprofile_drawn.log" "$OUT/feedprofile_npy.log" \
            | tee -a "$OUT/summary.txt"
        ;;
    kaggle)
        kaggle_run kaggle 150
        ;;
    kaggle_bf16)
        kaggle_run kaggle_bf16 150 --set model.precision=bf16
        ;;
    kaggle_compile)
        kaggle_run kaggle_compile 200 --set train.compile=true
        ;;
    dcnv2)
        run dcnv2 150 $PY -m neorec train --config mlperf_dcnv2 --set train.device=cuda \
            --set model.precision=bf16 --set data.batch_size=16384 --set train.max_steps=120 --set train.log_every=10 "${COMMON[@]}" --output-dir "$OUT/dcnv2"
        summary "$OUT/dcnv2" | tee -a "$OUT/summary.txt"
        ;;
    ranks)
        run ranks1 100 $PY -m neorec train --config criteo_kaggle --set train.device=cuda --set data.batch_size=16384 \
            --set train.max_steps=120 --set train.log_every=10 "${COMMON[@]}" --output-dir "$OUT/ranks1"
        run ranks2 100 $PY -m neorec train --config criteo_kaggle --nproc 2 --set train.device=cuda \
            --set data.batch_size=16384 --set distributed.backend=gloo --set train.max_steps=120 --set train.log_every=10 \
            "${COMMON[@]}" --output-dir "$OUT/ranks2"
        summary "$OUT/ranks1" | tee -a "$OUT/summary.txt"
        summary "$OUT/ranks2" | tee -a "$OUT/summary.txt"
        ;;
    ops)
        run ops ${OPS_LIMIT:-240} $PY benchmarks/embedding_ops_gpu.py --scales 8 --optimizers rowwise_adagrad,sgd,adam \
            --profile --results "$OUT/gpu-results.jsonl"
        ;;
    stages)
        run stages ${STAGES_LIMIT:-200} $PY benchmarks/embedding_stages.py --device cuda --scales 8 \
            --results "$OUT/gpu-results.jsonl"
        ;;
    warm)
        rm -rf "${KERNEL_CACHE:-/tmp/neorec-kernels}"
        for run_name in warm_first warm_second; do
            kaggle_run $run_name 150 --set train.max_steps=244 --set train.kernel_cache="${KERNEL_CACHE:-/tmp/neorec-kernels}"
        done
        ;;
    ab)
        if [ ! -d "${BEFORE:-}/neorec" ]; then
            echo "step ab: set BEFORE to a folder holding an earlier tree (git archive REV neorec benchmarks | tar -x -C DIR)" >&2
            exit 2
        fi
        for round in $(seq "${AB_ROUNDS:-2}"); do  # the earlier tree's kernels and this tree's in turn, on the same GPU
            for side in before after; do
                root=.; [ $side = before ] && root=$BEFORE
                run ab_${side}_$round ${AB_LIMIT:-120} $PY "$root/benchmarks/embedding_ops_gpu.py" --impls triton \
                    --scales 8 --optimizers rowwise_adagrad,sgd --results "$OUT/ab-$side.jsonl"
            done
        done
        ;;
    cache)
        run cache ${CACHE_LIMIT:-150} $PY benchmarks/cache.py --device cuda --tier dram --zipf 1.05 --fractions 0.2 1.0 \
            --io-thread on off --repeats 1 --warmup ${CACHE_WARMUP:-300} --steps 60 --dir /tmp/neorec-tables \
            --no-append --profile
        ;;
    cache_ssd)
        run cache_ssd ${SSD_LIMIT:-200} $PY benchmarks/cache.py --device cuda --tier ssd --zipf 1.05 --fractions 0.2 \
            --repeats 1 --warmup ${CACHE_WARMUP:-300} --steps 60 --dir "${SSD_DIR:-/tmp/neorec-ssd}" \
            --no-append
        ;;
    ingestion)
        run ingestion ${INGESTION_LIMIT:-240} $PY benchmarks/ingestion.py --criteo-lines 1000000 4000000 --repeats 3 \
            --torchrec-max-lines 0 --no-append
        ;;
    *)
        echo "unknown step $step (env tests kernels cachetests ranktests gputests bounds sources stages warm ab profile kaggle kaggle_bf16 kaggle_compile dcnv2 ranks ops cache cache_ssd ingestion)" >&2
        exit 2
        ;;
    esac
done
echo "== summary"
cat "$OUT/summary.txt"
