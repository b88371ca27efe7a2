#!/usr/bin/env bash
# Installs every Debian package Ember's build, tests, benchmarks and demo need.
# Idempotent: packages already installed are skipped; nothing is downloaded
# when all are present. Works as root on a fresh Debian 12 (uses sudo when
# not root). CUDA's nvcc is not a Debian package here: it is used when found
# on PATH or in /usr/local/cuda, and the CPU-only build is first-class.
set -euo pipefail
case "${1-}" in
  "") ;;
  -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
  *) echo "install-deps.sh: unknown argument '$1' (it takes none; see --help)" >&2; exit 2 ;;
esac

PACKAGES=(
  # toolchain
  build-essential cmake ninja-build pkg-config git clang libclang-rt-14-dev
  # libraries
  libboost-dev libboost-system-dev libtoml11-dev libspdlog-dev libfmt-dev libcli11-dev
  libexpected-dev libisal-dev libeigen3-dev zlib1g-dev libsystemd-dev
  # RDMA (rdma-core) and its Soft-RoCE provider
  libibverbs-dev librdmacm-dev ibverbs-providers rdma-core
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  libconcurrentqueue-dev libmimalloc-dev libgloo-dev
  # data, Python package, tooling
  dataset-fashion-mnist python3 python3-numpy python3-pytest python3-matplotlib python3-yaml
  # operator files: systemd-analyze (unit check), shellcheck, perf (scripts/profile)
  systemd shellcheck linux-perf
  iproute2 procps util-linux
  # the Soft-RoCE guest of the rdma suite (scripts/rdma-vm/): emulator, initramfs tools
  qemu-system-x86 busybox-static kmod cpio
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then SUDO=(sudo); else
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
