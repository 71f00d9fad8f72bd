#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root: unpacks the bundle made by
# scripts/gpu-test.sh, runs the selected binaries, writes logs and a summary to
# $OUT (or ./gpu-out) and exits non-zero if anything failed. At most 8 files
# come back from the GPU machine, so the logs and the benches' result files are
# packed into one logs.tar.gz beside summary.txt.
#   bash gpu-bundle/run.sh [tests] [benches] [examples]
# RUN_TAG=x names the outputs summary-x.txt and logs-x.tar.gz (several runs
# in one device call). RUN_TAR=all.tar appends both to $OUT/all.tar instead,
# so any number of runs come back as one file, a run cut by a time limit
# included (at most 8 files come back from a device call). GPU_ONLY=a,b runs only binaries whose name contains one of those words;
# GPU_ARGS_<name> (e.g. GPU_ARGS_train_mlp) passes arguments to an example.
# With `benches`, every benches/*_torch.py (PyTorch references) runs too, before
# the benches, with arguments from PY_ARGS_<name> (e.g. PY_ARGS_adamw_torch=--full).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# Benches write their results here (the path baked in at build time is this
# machine's checkout, not the GPU machine's).
export BENCH_RESULTS_DIR=${BENCH_RESULTS_DIR:-$PWD/benches/results}
mkdir -p "$BENCH_RESULTS_DIR"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# NCCL (streamer-dist links libnccl.so.2): on the GPU machine it exists only
# inside the PyTorch wheels (nvidia-nccl-cu*); put its folder on the path.
nccl_lib=$(bash "$here/nccl-lib.sh" || true)
nccl_note=""
if [ -n "$nccl_lib" ] && [ -e "$nccl_lib/libnccl.so.2" ]; then
  export LD_LIBRARY_PATH=$nccl_lib:$LD_LIBRARY_PATH
  nccl_note="libnccl.so.2 from $nccl_lib"
else
  nccl_note="WARNING: libnccl.so.2 not found in the nvidia-nccl wheel; binaries that link NCCL will not start"
  echo "run.sh: $nccl_note" >&2
fi
# Our kernels ship machine code for the build's GPU, but Candle's reach the
# driver as PTX and are compiled at first launch; a cache big enough for all
# of them lets the later processes of the same call reuse that work.
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
work=$(mktemp -d)
xz -dc "$here/bin.tar.xz" | tar -C "$work" -xf -
want="${*:-tests benches examples}"
summary=$out/summary${RUN_TAG:+-$RUN_TAG}.txt
logs=$work/logs
mkdir -p "$logs"
: >"$summary"
fail=0
pack_logs() {
  mkdir -p benches/results
  local logs_tgz=logs${RUN_TAG:+-$RUN_TAG}.tar.gz
  tar -czf "$out/$logs_tgz" -C "$work" logs -C "$PWD" benches/results 2>/dev/null
  if [ -n "${RUN_TAR:-}" ]; then
    tar -C "$out" -rf "$out/$RUN_TAR" "$logs_tgz" "$(basename "$summary")" &&
      rm -f "$out/$logs_tgz" "$summary"
  fi
}
# A stage cut by `timeout` (SIGTERM to the whole group) still leaves what its
# binaries logged so far, and says where it stopped.
current="(before any binary)"
trap 'echo "STOPPED    $current: SIGTERM (a time limit); its log so far is in the logs tarball" | tee -a "$summary"; pack_logs; exit 124' TERM
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$summary" 2>&1 || true
# Benches name their result files after the GPU (h100, h200); the tag comes
# from the card's name unless BENCH_DEVICE_TAG is set.
if [ -z "${BENCH_DEVICE_TAG:-}" ]; then
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  tag=$(grep -oE '[HAB][0-9]{2,3}' <<<"$card" | head -n 1 | tr 'A-Z' 'a-z')
  [ -n "$tag" ] && export BENCH_DEVICE_TAG=$tag
fi
echo "$nccl_note" >>"$summary"
# Test binaries run once per topic (GPU_TEST_TOPICS, default: every module of
# tests/main.rs), so a crash in one topic cannot hide the others' results.
topics=${GPU_TEST_TOPICS:-$(sed -n 's/^mod \([a-z_0-9]*\);$/\1/p' tests/main.rs | tr '\n' ' ')}
export RUST_BACKTRACE=${RUST_BACKTRACE:-0}
entries=()
while IFS=$'\t' read -r kind bin; do
  if [ "$kind" = test ]; then
    for t in $topics; do entries+=("$kind	$bin	$t"); done
  else
    entries+=("$kind	$bin	")
  fi
done <"$here/manifest"
# PyTorch references first: the benches draw their figures into their plots.
if [[ " $want " == *" benches "* ]]; then
  for py in benches/*_torch.py; do
    [ -f "$py" ] || continue
    name=$(basename "$py" .py)
    if [ -n "${GPU_ONLY:-}" ]; then
      keep=0
      for w in ${GPU_ONLY//,/ }; do [[ "$name" == *"$w"* ]] && keep=1; done
      [ $keep -eq 1 ] || continue
    fi
    current=$name
    start=$(date +%s)
    pyvar="PY_ARGS_$name"
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 python3 "$py" ${!pyvar:-} >"$logs/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then status=PASS; else status="FAIL(rc=$rc)"; fail=1; fi
    printf '%-10s %-40s %4ss\n' "$status" "$name" "$(( $(date +%s) - start ))" | tee -a "$summary"
  done
fi
for entry in "${entries[@]}"; do
  IFS=$'\t' read -r kind bin topic <<<"$entry"
  case "$kind" in
    test) group=tests ;; bench) group=benches ;; example) group=examples ;; *) group=other ;;
  esac
  [[ " $want " == *" $group "* ]] || continue
  if [ -n "${GPU_ONLY:-}" ]; then
    keep=0
    for w in ${GPU_ONLY//,/ }; do [[ "$bin" == *"$w"* ]] && keep=1; done
    [ $keep -eq 1 ] || continue
  fi
  log=$logs/$bin${topic:+-$topic}.log
  current="$bin${topic:+ $topic}"
  start=$(date +%s)
  case "$kind" in
    test) "$work/bin/$bin" --test-threads=2 "$topic::" >"$log" 2>&1 ;;
    bench) "$work/bin/$bin" --bench >"$log" 2>&1 ;;
    example)
      var="GPU_ARGS_${bin#example-}"
      # shellcheck disable=SC2086
      "$work/bin/$bin" ${!var:-} >"$log" 2>&1 ;;
  esac
  rc=$?
  secs=$(( $(date +%s) - start ))
  if [ $rc -eq 0 ]; then status=PASS; else status="FAIL(rc=$rc)"; fail=1; fi
  detail=$(grep -E '^test result:' "$log" | tail -n 1)
  printf '%-10s %-40s %4ss %s\n' "$status" "$bin${topic:+ $topic}" "$secs" "$detail" | tee -a "$summary"
  if [ "$kind" = test ]; then grep -E -A2 '^test .* FAILED$|panicked' "$log" | grep -v -- '^--$' | head -n 40 | tee -a "$summary"; fi
done
echo "overall: $([ $fail -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$summary"
pack_logs
exit $fail
