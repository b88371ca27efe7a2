#!/usr/bin/env bash
# Runs a command inside Ember's Soft-RoCE guest and returns its exit status.
#
#   scripts/rdma-vm/run.sh [--timeout SECS] [--mem SIZE] [--smp N] [--quiet] -- CMD [ARGS...]
#
# The guest is a stock Debian kernel under qemu (KVM when /dev/kvm is
# usable, else software emulation), with Soft-RoCE device rxe0 on a dummy
# netdev at 198.18.0.1 (exported to CMD as EMBER_RDMA_IP; rdma_cm programs
# must use it, not 127.0.0.1). CMD runs as root, chrooted into the host's
# /usr and /etc (read-only) with this repository mounted read-write at the
# same path, in the current directory (which must be inside the repository),
# with RLIMIT_MEMLOCK unlimited. The guest has no network device: nothing
# leaves it. Binaries must not need CPU features the emulated CPU lacks:
# build them without -march=native (the dev preset is fine).
#
# Exit status: CMD's; 98 when the guest never reported one (boot failure,
# crash, or the time limit: qemu is killed after --timeout + 60 s); 99 when
# the guest could not set up Soft-RoCE (the console says why).
# The serial console is copied to stdout (unless --quiet) and to
# build/rdma-vm/console-<pid>.log.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${EMBER_RDMA_VM_DIR:-$REPO/build/rdma-vm}
timeout_s=600; mem=2G; smp=2; quiet=0
while (($#)); do
  case "$1" in
    --timeout) timeout_s="$2"; shift 2 ;;
    --mem) mem="$2"; shift 2 ;;
    --smp) smp="$2"; shift 2 ;;
    --quiet) quiet=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "rdma-vm/run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
(($# > 0)) || { echo "rdma-vm/run.sh: no command after -- (see --help)" >&2; exit 2; }
cwd=$(pwd -P)
case "$cwd/" in "$REPO"/*) ;; *)
  echo "rdma-vm/run.sh: run it from inside $REPO (the guest sees only the repository and /usr, /etc)" >&2
  exit 2 ;;
esac

"$HERE/image.sh" || exit 98

# The payload: a script in the shared repository tree, so the guest can run it.
mkdir -p "$REPO/build/rdma-vm"
payload=$REPO/build/rdma-vm/payload-$$.sh
log=$REPO/build/rdma-vm/console-$$.log
{
  echo '#!/bin/sh'
  printf 'cd %q || exit 97\n' "$cwd"
  printf 'exec'; printf ' %q' "$@"; printf '\n'
} > "$payload"
chmod +x "$payload"
trap 'rm -f "$payload"' EXIT

# KVM only when the CPU offers virtualisation: some sandboxes expose a
# /dev/kvm that cannot run a guest (it spins without booting).
accel=tcg
if [[ -w /dev/kvm ]] && grep -qwE 'vmx|svm' /proc/cpuinfo; then accel=kvm; fi
start=$(date +%s)
# qemu is killed 60 s after the guest's own payload limit (boot and power-off
# take well under that), so a hung guest fails instead of hanging CI.
timeout -k 10 $((timeout_s + 60)) qemu-system-x86_64 \
  -accel "$accel" -cpu max -m "$mem" -smp "$smp" \
  -nographic -no-reboot -nic none \
  -kernel "$OUT/vmlinuz" -initrd "$OUT/initramfs.cpio" \
  -virtfs local,path=/usr,mount_tag=hostusr,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path=/etc,mount_tag=hostetc,security_model=none,readonly=on,multidevs=remap \
  -virtfs "local,path=$REPO,mount_tag=repo,security_model=none,multidevs=remap" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init ember.repo=$REPO ember.cmd=$payload ember.timeout=$timeout_s" \
  </dev/null 2>&1 | sed -u -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e 's/\x1bc//g' -e 's/\r$//' |
  if ((quiet)); then cat > "$log"; else tee "$log"; fi
qemu_rc=${PIPESTATUS[0]}
elapsed=$(($(date +%s) - start))
rc=$(sed -n 's/^EMBER_RDMA_VM_DONE rc=\([0-9]*\).*/\1/p' "$log" | tail -n1)
if [[ -z $rc ]]; then
  echo "rdma-vm: the guest reported no result (qemu exit $qemu_rc after ${elapsed}s, accel=$accel); console: $log" >&2
  exit 98
fi
echo "rdma-vm: guest finished in ${elapsed}s (accel=$accel), payload exit status $rc"
exit "$rc"
