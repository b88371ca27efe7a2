#!/bin/bash
# `cmake --install` into a temporary prefix gives a usable tree: the binaries,
# libember and its header, the systemd unit (its paths rewritten to the
# prefix), the hugepage helpers and the docs; the installed ember-server and
# emberctl run from there.
#
#   install_test.sh CMAKE BUILD_DIR
set -u
cmake_bin=$1
build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "install_test: FAIL: $*" >&2; exit 1; }

"$cmake_bin" --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 \
  || fail "cmake --install failed:
$(cat "$tmp/install.log")"

for f in bin/ember-server bin/emberctl libexec/ember/reserve-hugepages.sh; do
  [[ -x $prefix/$f ]] || fail "$f missing or not executable; installed:
$(cd "$prefix" && find . -type f | sort)"
done
for f in include/ember/ember.h lib/systemd/system/ember-server.service \
         lib/sysctl.d/99-ember-hugepages.conf share/doc/ember/README.md \
         share/doc/ember/troubleshooting.md share/doc/ember/examples/ember.toml; do
  [[ -f $prefix/$f ]] || fail "$f missing; installed:
$(cd "$prefix" && find . -type f | sort)"
done
ls "$prefix"/lib/libember.so.* >/dev/null 2>&1 || fail "lib/libember.so.<abi> missing"

# The unit starts the installed server and helper, whatever the prefix.
unit=$prefix/lib/systemd/system/ember-server.service
grep -qx "ExecStart=$prefix/bin/ember-server --config /etc/ember/ember.toml" "$unit" \
  || fail "ExecStart does not name $prefix/bin/ember-server: $(grep ExecStart= "$unit")"
grep -qx "ExecStartPre=+$prefix/libexec/ember/reserve-hugepages.sh 256" "$unit" \
  || fail "ExecStartPre does not name the installed helper: $(grep ExecStartPre= "$unit")"
grep -q "file://$prefix/share/doc/ember/troubleshooting.md" "$unit" \
  || fail "Documentation= does not name the installed docs"
if grep -v '^#' "$unit" | grep -q /usr/local; then
  fail "the installed unit still names /usr/local: $(grep -v '^#' "$unit" | grep /usr/local)"
fi

# The installed programs run from the tree (no reference back to the build).
out=$("$prefix/bin/ember-server" --help 2>&1) || fail "ember-server --help failed: $out"
grep -q -- "--config" <<<"$out" || fail "ember-server --help does not list --config: $out"
out=$("$prefix/bin/emberctl" --help 2>&1) || fail "emberctl --help failed: $out"
grep -q "status" <<<"$out" || fail "emberctl --help does not list status: $out"
out=$("$prefix/bin/emberctl" config check "$prefix/share/doc/ember/examples/ember.toml" 2>&1) \
  || fail "emberctl config check of the installed example config failed: $out"
echo "install_test: ok ($prefix)"
