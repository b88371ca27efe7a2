#!/bin/sh
# ExecStartPre helper (runs as root, '+' prefix): makes sure at least N 2 MiB
# hugepages are reserved before ember-server starts, so its page pool can use
# MFD_HUGETLB. If the kernel cannot reserve them (fragmented memory), the
# server falls back to transparent hugepages and says so in its log; this
# script never fails the start for that reason.
#
#   reserve-hugepages.sh [N]    N: number of 2 MiB pages (default 256 = 512 MiB)
set -eu
want=${1:-256}
case $want in
  -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
  ''|*[!0-9]*)
    echo "reserve-hugepages: the argument must be a number of 2 MiB pages (got '$want')" >&2
    exit 2 ;;
esac
have=$(cat /proc/sys/vm/nr_hugepages)
if [ "$have" -lt "$want" ]; then
  echo "$want" > /proc/sys/vm/nr_hugepages || true
fi
echo "reserve-hugepages: wanted $want, now $(cat /proc/sys/vm/nr_hugepages)"
