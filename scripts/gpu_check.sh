#!/usr/bin/env bash
# The GPU check, one command on a machine with an NVIDIA GPU, torch with CUDA,
# cuda-bindings and transformers (flash-attn and pytest optional), offline:
# installs vattn from this working tree with no download, then `vattn bench
# gpu` runs the backend contract, the CUDA tests, the VMM latency, the
# attention kernels and a short engine run, each in a process of its own under
# a time limit, printing a summary table last.  Exit status: 0 when every part
# that ran passed, 1 when one failed or timed out, 2 (one line, why) where
# there is no GPU, 124 past 8 minutes in all.  With $OUT set, the figures go
# to $OUT/gpu_check.json and the log to $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-160}
LOG=${OUT:+$OUT/gpu_check.log}
LOG=${LOG:-/dev/null}

# pip with the environment's own setuptools, unless this tree's vattn imports already with its native
# build newer than every native source; where pip cannot build the extension (no setuptools, or one too
# old for pyproject's ext-modules), compile it in place and put the tree on the path
NATIVE=$($PY -c "import vattn._native as n; print(n.__file__)" 2>/dev/null)
if [[ "$NATIVE" != "$PWD/vattn/"* || -n "$(find native -newer "$NATIVE")" ]]; then
    timeout 120 $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$LOG" 2>&1
fi
if ! $PY -c "import vattn._native" 2>/dev/null; then
    echo "building vattn._native in place" | tee -a "$LOG"
    INCLUDE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
    SUFFIX=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    ${CC:-cc} -O3 -shared -fPIC -fopenmp -I"$INCLUDE" native/*.c -o "vattn/_native$SUFFIX" \
        2>&1 | tee -a "$LOG" || exit 1
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    $PY -c "import vattn._native" || exit 1
fi
timeout 480 $PY -m vattn bench gpu ${OUT:+--json "$OUT/gpu_check.json"} 2>&1 | tee -a "$LOG"
