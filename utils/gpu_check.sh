#!/usr/bin/env bash
# The GPU check, in one command: the GPU tests (tests/generation/test_gpu.py) and the GPU benchmark
# (utils/gpu_bench.py, when it exists), on one CUDA GPU, in under 8 minutes on an H200.
#
#   bash utils/gpu_check.sh             # on the GPU machine
#   bash utils/gpu_check.sh --dry-run   # anywhere (CI): the same phases on CPU, in about a minute
#
# Phases, each under its own `timeout`, all inside one time budget:
#   1. env      versions of python, torch, triton, transformers and the GPU name          -> $OUT/env.txt
#   2. install  `pip install --no-deps -e .`, offline (no index, no build isolation)      -> $OUT/install.log
#   3. tests    RUN_SLOW=1 python -m pytest tests/generation/test_gpu.py                 -> $OUT/pytest_gpu.{log,xml}
#   4. bench    python utils/gpu_bench.py (skipped, with a message, if the file is absent) -> $OUT/gpu_bench.log
#   4b. warm start  utils/measure_warm_start.py on CUDA, `aot_forward` and `reduce-overhead`: cold process, then
#               warm (GPU run only, with the time left; `aot_forward` skipped, with the reason, on a torch older
#               than 2.13)                                                               -> $OUT/warm_start_*.log
#   5. multi-gpu  with 2 or more GPUs: utils/tp_bench.py under torchrun (NCCL, tp_plan="auto", 2 ranks), a cold
#               launch that saves each rank's compile cache, then a warm one that loads it -> $OUT/tp_bench_*.log
#               (skipped, with a message, when fewer than 2 GPUs are visible, as in a dry run)
#   6. summary  a table of the phases, tests and measured numbers                         -> $OUT/summary.md
# It exits non-zero when a test fails, errors or times out, or the benchmark fails. An install that fails is
# reported, and the tests then import the package from src/ (PYTHONPATH) so that they still run.
#
# Dry run (`--dry-run`, or GPU_CHECK_DRY=1): the same phases, with the GPU hidden (CUDA_VISIBLE_DEVICES=""):
# pip only resolves the install (`pip install --dry-run`), the GPU tests must all skip with a reason (checked from
# the JUnit XML, and pytest must exit 0), and the benchmark runs in its `--quick` mode if it has one.
#
# Environment:
#   OUT               where results go (the device tool sets it); default ./gpu_results
#   PYTHON            the interpreter; default `python` on PATH, else `python3`
#   GPU_CHECK_DRY     1 for a dry run
#   GPU_CHECK_BUDGET  seconds for the whole check; default 470 (GPU, plus 240 with 2 or more GPUs) or 170 (dry run)
#   GPU_BENCH_ARGS    extra arguments for utils/gpu_bench.py (split on spaces)
set -euo pipefail

usage() {
    sed -n '2,/^set -euo pipefail$/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

is_true() {
    case "${1,,}" in
        1 | true | yes | on) return 0 ;;
        *) return 1 ;;
    esac
}

DRY_RUN=0
if is_true "${GPU_CHECK_DRY:-0}"; then
    DRY_RUN=1
fi
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h | --help)
            usage
            exit 0
            ;;
        *)
            echo "gpu_check.sh: unknown argument '$arg'" >&2
            usage >&2
            exit 2
            ;;
    esac
done

# $OUT is resolved from where the script is called, then everything runs from the repository root.
OUT="${OUT:-./gpu_results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export OUT
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

if [[ -z "${PYTHON:-}" ]]; then
    PYTHON="$(command -v python || command -v python3 || true)"
fi
if [[ -z "$PYTHON" ]]; then
    echo "gpu_check.sh: no python on PATH; set PYTHON" >&2
    exit 2
fi

if ((DRY_RUN)); then
    BUDGET="${GPU_CHECK_BUDGET:-170}"
    # Hide any GPU: a dry run checks the script's logic and the CPU behaviour of the GPU tests (they skip).
    export CUDA_VISIBLE_DEVICES=""
    MODE="dry run (CPU, GPU hidden)"
else
    BUDGET="${GPU_CHECK_BUDGET:-470}"
    MODE="GPU run"
fi
# Caps per phase (seconds); every phase also stops at the overall budget, keeping RESERVE for the summary.
RESERVE=15
CAP_ENV=60
CAP_INSTALL=90
CAP_TESTS=300
CAP_BENCH=240
CAP_TP=120   # each of the two tp_bench launches
CAP_WARM=120 # each of the two warm-start measurements (after the benchmark, with the time left)

START=$SECONDS
FAILED=0
PHASES="$OUT/phases.tsv"
: >"$PHASES"

record() { # phase status seconds log
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4#"$OUT"/}" >>"$PHASES"
}

# run_phase NAME CAP LOG COMMAND...: runs COMMAND under `timeout`, output to the terminal and LOG; sets PHASE_RC.
# FAIL_NOTE, when set, is added to the phase's status if it fails.
PHASE_RC=0
FAIL_NOTE=""
run_phase() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((BUDGET - (SECONDS - START) - RESERVE))
    local limit=$((cap < left ? cap : left))
    if ((limit < 5)); then
        echo "==> $name: no time left in the ${BUDGET}s budget" | tee "$log"
        record "$name" "not run (budget)" 0 "$log"
        PHASE_RC=124
        return 0
    fi
    echo "==> $name (timeout ${limit}s): $*"
    local began=$SECONDS
    PHASE_RC=0
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log" || PHASE_RC=${PIPESTATUS[0]}
    local took=$((SECONDS - began))
    local status
    case "$PHASE_RC" in
        0) status="ok" ;;
        124 | 137) status="timed out after ${limit}s" ;;
        *) status="failed (exit $PHASE_RC)" ;;
    esac
    if ((PHASE_RC != 0)) && [[ -n "$FAIL_NOTE" ]]; then
        status="$status, $FAIL_NOTE"
    fi
    record "$name" "$status" "$took" "$log"
    echo "==> $name: $status in ${took}s"
}

echo "gpu_check.sh: $MODE, results in $OUT, budget ${BUDGET}s, python $PYTHON"

# ---- 1. env ------------------------------------------------------------------------------------------------------
run_phase env "$CAP_ENV" "$OUT/env.txt" "$PYTHON" utils/gpu_check.py env
if ((PHASE_RC != 0)); then
    FAILED=1
fi

# ---- 2. install --------------------------------------------------------------------------------------------------
# Offline: --no-index (nothing is downloaded), --no-build-isolation (the installed setuptools builds it), --no-deps
# (torch and transformers are the machine's own). A dry run only resolves it.
pip_args=(install --no-deps --no-index --no-build-isolation --disable-pip-version-check)
if ((DRY_RUN)); then
    pip_args+=(--dry-run)
fi
FAIL_NOTE="tests import from src/ (PYTHONPATH)"
run_phase install "$CAP_INSTALL" "$OUT/install.log" "$PYTHON" -m pip "${pip_args[@]}" -e .
FAIL_NOTE=""
if ((PHASE_RC != 0)); then
    echo "==> install failed: the tests import prefill_buckets from src/ instead (PYTHONPATH)"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi

# ---- 3. tests ----------------------------------------------------------------------------------------------------
junit="$OUT/pytest_gpu.xml"
rm -f "$junit" "$OUT/gpu_test_metrics.json"
run_phase tests "$CAP_TESTS" "$OUT/pytest_gpu.log" \
    env RUN_SLOW=1 PREFILL_BUCKETS_GPU_RESULTS="$OUT" \
    "$PYTHON" -m pytest tests/generation/test_gpu.py -v -rs -p no:cacheprovider --junitxml="$junit"
tests_rc=$PHASE_RC
expect=pass
if ((DRY_RUN)); then
    expect=skip
fi
echo "==> tests: checking $junit (expect: $expect)"
if ! verdict="$("$PYTHON" utils/gpu_check.py junit --expect "$expect" "$junit")"; then
    FAILED=1
    echo "$verdict"
    echo "==> tests: FAILED"
    record "tests verdict" "FAILED: $(tail -n 1 <<<"$verdict")" 0 "$junit"
elif ((tests_rc != 0)); then
    FAILED=1
    echo "$verdict"
    echo "==> tests: pytest exited $tests_rc"
    record "tests verdict" "FAILED: pytest exited $tests_rc" 0 "$junit"
else
    echo "$verdict"
    record "tests verdict" "as expected ($expect): $(head -n 1 <<<"$verdict")" 0 "$junit"
fi

# ---- 4. bench ----------------------------------------------------------------------------------------------------
BENCH=utils/gpu_bench.py
if ! test -f "$BENCH"; then
    echo "==> bench: $BENCH not found: skipping the benchmark"
    record bench "skipped ($BENCH not found)" 0 ""
else
    bench_args=()
    if [[ -n "${GPU_BENCH_ARGS:-}" ]]; then
        read -r -a bench_args <<<"$GPU_BENCH_ARGS"
    fi
    # Pass the output folder if the script takes one; it can also read $OUT itself.
    out_flag="$(grep -oE -- '"--(out|output|out-dir|output-dir|results-dir)"' "$BENCH" | head -n 1 | tr -d '"' || true)"
    if [[ -n "$out_flag" ]]; then
        bench_args+=("$out_flag" "$OUT/bench")
    fi
    if ((DRY_RUN)); then
        if grep -q -- '"--quick"' "$BENCH"; then
            run_phase bench "$CAP_BENCH" "$OUT/gpu_bench.log" "$PYTHON" "$BENCH" --quick "${bench_args[@]}"
            if ((PHASE_RC != 0)); then
                FAILED=1
            fi
        else
            echo "==> bench: $BENCH has no --quick mode: not run in a dry run"
            record bench "skipped (no --quick mode)" 0 ""
        fi
    else
        run_phase bench "$CAP_BENCH" "$OUT/gpu_bench.log" "$PYTHON" "$BENCH" "${bench_args[@]}"
        if ((PHASE_RC != 0)); then
            FAILED=1
        fi
    fi
fi

# ---- 4b. warm start ----------------------------------------------------------------------------------------------
# A cold process that compiles a tiny Llama's pow2 buckets and saves the compile cache, then a warm one that loads it
# (utils/measure_warm_start.py): with `aot_forward` (nothing traced warm), and with `mode="reduce-overhead"` (traced
# again, and its CUDA graphs recorded again). Run with the time left after the benchmark; not in a dry run, where
# the same script costs minutes of CPU compiling (CI tests `aot_forward`'s warm start on CPU).
if ((DRY_RUN)); then
    echo "==> warm start: skipped in a dry run (CPU compiles take minutes)"
    record "warm start" "skipped (dry run)" 0 ""
else
    # `aot_forward` needs torch 2.13 (it raises, naming the version, before): skipped with that reason on an older one.
    aot_problem="$("$PYTHON" -c 'from prefill_buckets.upstream.checks import aot_compile_problem as p; print(p() or "")' \
        2>&1 | tail -n 1)"
    for compile_with in aot_forward reduce-overhead; do
        if [[ "$compile_with" == aot_forward && -n "$aot_problem" ]]; then
            echo "==> warm start ($compile_with): skipped: $aot_problem"
            record "warm start ($compile_with)" "skipped ($aot_problem)" 0 ""
            continue
        fi
        run_phase "warm start ($compile_with)" "$CAP_WARM" "$OUT/warm_start_$compile_with.log" \
            "$PYTHON" utils/measure_warm_start.py --device cuda --max-prompt-length 256 --compile "$compile_with"
        if ((PHASE_RC != 0 && PHASE_RC != 124)); then
            FAILED=1
        fi
    done
fi

# ---- 5. multi-gpu ------------------------------------------------------------------------------------------------
# Tensor parallelism needs 2 or more devices: 2 ranks, one GPU each, NCCL. The tiny config-built Llama (its 4 heads
# and 2 kv heads split in 2) keeps it short; the second launch loads the compile caches the first saved.
gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
if ((gpus < 2)); then
    echo "==> multi-gpu: skipped: $gpus CUDA device(s) visible, tensor parallelism needs 2 or more"
    record multi-gpu "skipped ($gpus CUDA device(s) visible, needs 2 or more)" 0 ""
else
    if [[ -z "${GPU_CHECK_BUDGET:-}" ]]; then
        BUDGET=$((BUDGET + 2 * CAP_TP))
    fi
    tp=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 utils/tp_bench.py --tiny)
    tp+=(--cache-dir "$OUT/tp_bench")
    run_phase "multi-gpu cold" "$CAP_TP" "$OUT/tp_bench_cold.log" "${tp[@]}" --fresh
    if ((PHASE_RC != 0)); then
        FAILED=1
    else
        run_phase "multi-gpu warm" "$CAP_TP" "$OUT/tp_bench_warm.log" "${tp[@]}"
        if ((PHASE_RC != 0)); then
            FAILED=1
        fi
    fi
fi

# ---- 6. summary --------------------------------------------------------------------------------------------------
echo
"$PYTHON" utils/gpu_check.py summary --out "$OUT" || FAILED=1
echo
if ((FAILED)); then
    echo "gpu_check.sh: FAILED ($MODE, $((SECONDS - START))s); see $OUT"
    exit 1
fi
echo "gpu_check.sh: passed ($MODE, $((SECONDS - START))s); results in $OUT"
