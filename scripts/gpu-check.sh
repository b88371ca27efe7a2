#!/usr/bin/env bash
# scripts/gpu-check.sh: the GPU checks of worker/gpu (the SymBuffer kernels),
# in one go, in under 8 minutes on an H200 machine:
#   1. build the release preset with CUDA (sm_90) — only the gpu test binaries
#      and ember-bench-gpu — or, where the project's Debian dependencies are
#      missing (the lent device machines have CUDA but not them), run a bundle
#      prepared beforehand on a dev machine with --make-bundle;
#   2. gpu_kernels_test (label gpu): every kernel result compared bit for bit
#      with the CPU reference; EMBER_REQUIRE_GPU=1 makes a skip a failure;
#   3. the same once under compute-sanitizer memcheck, and a subset under
#      racecheck (shared-memory hazards) and synccheck (barrier misuse);
#   4. gpu_test (CPU reference, host emulation of the kernels);
#   4b. gpu_exchange_cuda_test (label gpu): DeviceExchange push_device /
#      pull_device of device tensors through a real in-process server,
#      compared bit for bit with the plain Worker (fp32) and with the CPU
#      backend (compressed groups), plus gpu_exchange_test (its CPU path);
#      the fp32 case once more under compute-sanitizer memcheck;
#   5. ember-bench-gpu: pack/unpack bandwidth against cudaMemcpy D2D for
#      ResNet-50's 161 tensors and 10,000 tensors of 4-64 KiB, host time per
#      pack call, channel sweep.
# The last line is `SUMMARY key=value ...`; the exit status is non-zero when a
# test or sanitizer run failed (never for a timing).
#
# usage:
#   scripts/gpu-check.sh                  build here if the dependencies are
#                                         there, else run build/gpu-bundle
#   scripts/gpu-check.sh --make-bundle    (any machine with nvcc, no GPU needed)
#                                         build and bundle into build/gpu-bundle
#   scripts/gpu-check.sh --bundle DIR     run the bundle in DIR
#   scripts/gpu-check.sh --no-gpu-ok      dry run on a machine without a GPU
#                                         (GPU tests skip, no sanitizers)
# On the device machine tool, after --make-bundle here:
#   run(command="scripts/gpu-check.sh", carry=["build/gpu-bundle"], timeout_s=540)
# Every step has its own time limit, and all of them together stay within
# EMBER_GPU_CHECK_BUDGET_S seconds (default 480) once the build is ready
# (a bundle: at once; the device tool's limit must cover a build here): a step that
# would run past it gets only what is left (a hang costs its step, not the
# SUMMARY line), and steps with nothing left are reported as `budget`.
# Logs go to $OUT (when set) as gpu-check.log and bench.txt.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=auto
bundle=build/gpu-bundle
require_gpu=1
while (($#)); do
  case "$1" in
    --make-bundle) mode=make-bundle; shift ;;
    --bundle) mode=bundle; bundle="$2"; shift 2 ;;
    --no-gpu-ok) require_gpu=0; shift ;;
    -h|--help) sed -n '2,39p' "$0"; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

out_dir="${OUT:-}"
log() { echo "== gpu-check: $*"; }
if [[ -n $out_dir ]]; then
  exec > >(tee -a "$out_dir/gpu-check.log") 2>&1
fi

targets=(gpu_kernels_test gpu_test ember-bench-gpu gpu_exchange_cuda_test gpu_exchange_test)
nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
start_s=$SECONDS
budget_s="${EMBER_GPU_CHECK_BUDGET_S:-480}"
bench_reserve_s=60  # kept for ember-bench-gpu by the steps before it

# --- building -----------------------------------------------------------------

configure_and_build() {  # $1 = build dir; extra cmake args follow
  local dir="$1"; shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=g++ -DCMAKE_C_COMPILER=gcc -DCMAKE_CXX_FLAGS="-O2 -march=x86-64-v3" \
    -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DEMBER_WITH_CUDA=ON "$@" >"$dir.configure.log" 2>&1 || return 1
  cmake --build "$dir" -j "$(nproc)" --target "${targets[@]}" || return 2
}

if [[ $mode == make-bundle ]]; then
  dir=build/gpu-bundle-build
  mkdir -p build
  # libstdc++ stays dynamic: the binaries then need only GLIBC 2.34 and
  # GLIBCXX 3.4.29 (Ubuntu 22.04 and later), while a static one pulls in
  # Debian 12's GLIBC 2.36 symbols. CUDA's runtime is linked statically.
  log "building ${targets[*]} in $dir (sm_90)"
  if ! configure_and_build "$dir" -DEMBER_CUDA_ARCHITECTURES=90 -DCMAKE_EXE_LINKER_FLAGS=; then
    cat "$dir.configure.log" >&2
    exit 1
  fi
  rm -rf "$bundle"
  mkdir -p "$bundle/bin" "$bundle/lib"
  cp "$dir/tests/unit/gpu/gpu_kernels_test" "$dir/tests/unit/gpu/gpu_test" \
     "$dir/bench/gpu/ember-bench-gpu" "$dir/tests/integration/gpu/gpu_exchange_cuda_test" \
     "$dir/tests/integration/gpu/gpu_exchange_test" "$bundle/bin/"
  strip --strip-debug "$bundle"/bin/*
  # Shared libraries that are not part of the base system (libfmt, ...).
  for bin in "$bundle"/bin/*; do
    ldd "$bin" | awk '/=> \// {print $3}'
  done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*|libcuda.so*) ;;
      *) cp -L "$lib" "$bundle/lib/" ;;
    esac
  done
  {
    echo "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "built $(date -u +%FT%TZ) on $(uname -n)"
    "$nvcc_bin" --version | tail -2
    echo "needs $(objdump -T "$bundle"/bin/* "$bundle"/lib/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)" \
         "and $(objdump -T "$bundle"/bin/* 2>/dev/null | grep -o 'GLIBCXX_[0-9.]*' | sort -Vu | tail -1)"
  } >"$bundle/MANIFEST"
  du -sh "$bundle"
  cat "$bundle/MANIFEST"
  log "bundle ready: carry build/gpu-bundle to the device machine and run scripts/gpu-check.sh there"
  exit 0
fi

bin_dir=""
if [[ $mode == auto ]]; then
  dir=build/release
  log "trying to build the release preset with CUDA (${targets[*]})"
  if cmake --preset release -DEMBER_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc_bin" >build/gpu-check.configure.log 2>&1 \
     && cmake --build "$dir" -j "$(nproc)" --target "${targets[@]}"; then
    bin_dir="$dir"
  else
    log "cannot build here (see build/gpu-check.configure.log: usually the Debian dependencies are missing); using the bundle $bundle"
    tail -5 build/gpu-check.configure.log 2>/dev/null || true
    mode=bundle
  fi
fi
if [[ $mode == bundle ]]; then
  if [[ ! -x $bundle/bin/gpu_kernels_test ]]; then
    echo "gpu-check.sh: no bundle at $bundle; make one with scripts/gpu-check.sh --make-bundle on a dev machine and carry it" >&2
    echo "SUMMARY gpu_check=no_build"
    exit 1
  fi
  cat "$bundle/MANIFEST" 2>/dev/null || true
  export LD_LIBRARY_PATH="$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ! "$bundle/bin/gpu_kernels_test" --gtest_list_tests >/dev/null 2>build/gpu-check.loader.log; then
    echo "gpu-check.sh: the bundle's binaries do not load here:" >&2
    cat build/gpu-check.loader.log >&2
    ldd "$bundle/bin/gpu_kernels_test" >&2 || true
    echo "SUMMARY gpu_check=bundle_does_not_load"
    exit 1
  fi
  kernels_test="$bundle/bin/gpu_kernels_test"
  ref_test="$bundle/bin/gpu_test"
  bench="$bundle/bin/ember-bench-gpu"
  exchange_test="$bundle/bin/gpu_exchange_cuda_test"
  exchange_ref_test="$bundle/bin/gpu_exchange_test"
else
  kernels_test="$bin_dir/tests/unit/gpu/gpu_kernels_test"
  ref_test="$bin_dir/tests/unit/gpu/gpu_test"
  bench="$bin_dir/bench/gpu/ember-bench-gpu"
  exchange_test="$bin_dir/tests/integration/gpu/gpu_exchange_cuda_test"
  exchange_ref_test="$bin_dir/tests/integration/gpu/gpu_exchange_test"
fi
log "build ready after $((SECONDS - start_s)) s"
checks_start_s=$SECONDS  # the budget counts from here (a build here is not in it)

# --- checks -------------------------------------------------------------------

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || log "nvidia-smi: no GPU visible"
summary=()
failed=0
export EMBER_REQUIRE_GPU=$require_gpu

run_step() {  # $1 = summary key, $2 = timeout s, then the command
  local key="$1" limit="$2"; shift 2
  local t0=$SECONDS
  local left=$((budget_s - (SECONDS - checks_start_s) - bench_reserve_s))
  if ((left < 10)); then
    summary+=("$key=budget"); failed=1
    log "$key: not run: the ${budget_s} s budget is spent"
    return
  fi
  ((limit > left)) && limit=$left
  log "$key: $*"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if ((rc == 0)); then
    summary+=("$key=pass")
  elif ((rc == 124 || rc == 137)); then
    summary+=("$key=timeout"); failed=1
  else
    summary+=("$key=fail"); failed=1
  fi
  log "$key: rc=$rc after $((SECONDS - t0)) s"
}

# Limits per step; the budget (above) caps their sum, keeping
# bench_reserve_s for the benchmark. A normal run takes a few minutes.
run_step gpu_tests 60 "$kernels_test" --gtest_brief=1
run_step gpu_ref_tests 30 "$ref_test" --gtest_brief=1
if [[ -x $exchange_test ]]; then
  run_step exchange_gpu 60 "$exchange_test" --gtest_brief=1
  run_step exchange_ref 30 "$exchange_ref_test" --gtest_brief=1
else
  summary+=("exchange_gpu=missing"); failed=1
  log "no $exchange_test (a bundle made before DeviceExchange: make it again)"
fi

sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
if ((require_gpu)) && [[ -x $sanitizer ]]; then
  # The 10,000-tensor case is covered above; under the sanitizer it only costs time.
  run_step memcheck 90 "$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 \
    "$kernels_test" --gtest_brief=1 --gtest_filter=-*TenThousand*
  # racecheck sees shared-memory hazards only; the kernels coordinate through
  # global memory, which the two-stream test exercises (APackAndAnUnpack...).
  run_step racecheck 45 "$sanitizer" --tool racecheck --error-exitcode 3 --print-limit 20 \
    "$kernels_test" --gtest_brief=1 \
    --gtest_filter=*MatchesTheCpuReferenceInDeviceMemory*:*FullRing*:*RejectsARecord*
  run_step synccheck 45 "$sanitizer" --tool synccheck --error-exitcode 3 --print-limit 20 \
    "$kernels_test" --gtest_brief=1 \
    --gtest_filter=*MatchesTheCpuReferenceInDeviceMemory*:*TwoStreams*:*RejectsARecord*
  if [[ -x $exchange_test ]]; then
    run_step exchange_memcheck 60 "$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 \
      "$exchange_test" --gtest_brief=1 --gtest_filter=*Fp32*:*HostPointers*
  fi
else
  summary+=("memcheck=skipped" "racecheck=skipped" "synccheck=skipped")
  log "compute-sanitizer not run (no GPU required or not installed)"
fi

bench_out="${out_dir:-build}/bench.txt"
mkdir -p "$(dirname "$bench_out")"
bench_limit=$((budget_s - (SECONDS - checks_start_s)))
((bench_limit > 90)) && bench_limit=90
((bench_limit < 10)) && bench_limit=10
log "ember-bench-gpu (limit ${bench_limit} s)"
timeout --kill-after=10 "$bench_limit" "$bench" | tee "$bench_out"
bench_rc=${PIPESTATUS[0]}
bench_summary="$(grep '^SUMMARY ' "$bench_out" | tail -1 | sed 's/^SUMMARY //')"
if ((bench_rc != 0)) || [[ -z $bench_summary ]]; then
  summary+=("bench=fail")
fi
log "done in $((SECONDS - start_s)) s"
echo "SUMMARY ${summary[*]} seconds=$((SECONDS - start_s)) ${bench_summary}"
exit $failed
