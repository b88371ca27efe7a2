#!/usr/bin/env bash
# systemd-analyze verify on deploy/systemd/ember-server.service.
#
# What this verifies: the unit's syntax and semantics as systemd 252 loads
# it (sections, keys, values, dependencies), with ExecStart pointing at the
# ember-server just built and ExecStartPre at the repository's
# reserve-hugepages.sh (verify requires them to exist and be executable);
# any warning fails the test (verify exits 0 on unknown keys or bad values,
# so its output must be empty). Also: `systemd-analyze security --offline`
# rates the hardening at most 3.0 ("OK"). What it does not verify: that the
# unit starts (that needs a running systemd as PID 1, which tests do not
# have): tests/scripts/server_ops_test.py checks the Type=notify protocol
# (READY=1, WATCHDOG=1) against the real binary instead.
# A negative control runs first: the unit with a missing binary must fail.
#   systemd_verify_test.sh EMBER_SERVER_BIN
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
server=$1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v systemd-analyze >/dev/null || fail "systemd-analyze is missing (apt-get install systemd)"
unit="$root/deploy/systemd/ember-server.service"
grep -q '^ExecStart=/usr/local/bin/ember-server ' "$unit" || fail "ExecStart is not /usr/local/bin/ember-server"
grep -q '^ExecStartPre=+/usr/local/libexec/ember/reserve-hugepages.sh' "$unit" || fail "ExecStartPre changed"

mkdir "$tmp/neg"
sed -e "s|/usr/local/libexec/ember/reserve-hugepages.sh|$root/deploy/systemd/reserve-hugepages.sh|" \
  "$unit" >"$tmp/neg/ember-server.service"
if systemd-analyze verify "$tmp/neg/ember-server.service" >"$tmp/neg.out" 2>&1; then
  fail "negative control: verify accepted a unit whose binary does not exist"
fi
grep -q "is not executable" "$tmp/neg.out" || fail "negative control: $(cat "$tmp/neg.out")"

mkdir "$tmp/unit"
sed -e "s|/usr/local/bin/ember-server|$server|" \
    -e "s|/usr/local/libexec/ember/reserve-hugepages.sh|$root/deploy/systemd/reserve-hugepages.sh|" \
  "$unit" >"$tmp/unit/ember-server.service"
systemd-analyze verify "$tmp/unit/ember-server.service" >"$tmp/verify.out" 2>&1 \
  || fail "systemd-analyze verify: $(cat "$tmp/verify.out")"
[[ ! -s $tmp/verify.out ]] || fail "systemd-analyze verify warned: $(cat "$tmp/verify.out")"

for key in Type=notify WatchdogSec= User=ember LimitMEMLOCK=infinity NoNewPrivileges=yes \
           ProtectSystem=strict PrivateTmp=yes ReadWritePaths=/var/lib/ember; do
  grep -q "^$key" "$unit" || fail "unit lacks $key"
done
score=$(systemd-analyze security --offline=yes "$tmp/unit/ember-server.service" 2>/dev/null \
  | sed -n 's/.*Overall exposure level for ember-server.service: \([0-9.]*\).*/\1/p')
[[ -n $score ]] || fail "no security score"
awk -v s="$score" 'BEGIN { exit !(s <= 3.0) }' || fail "hardening exposure $score > 3.0"
echo "systemd_verify_test: ok (exposure $score)"
