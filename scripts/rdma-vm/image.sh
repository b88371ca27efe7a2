#!/usr/bin/env bash
# Builds the Soft-RoCE guest: a stock Debian kernel (downloaded and unpacked,
# never installed) and a small initramfs holding busybox, iproute2's `ip` and
# `rdma`, the kernel modules rdma_rxe needs, the 9p modules, and our /init.
# The guest's payload runs chrooted into the host's /usr and /etc (shared
# read-only over 9p), so host-built Ember binaries run in it unchanged.
#
#   scripts/rdma-vm/image.sh [--check]
#     --check   only say whether an image can be built/used here; prints
#               "ok" or one line with the reason, exit 0/1. Builds nothing.
#
# Output (cached; rebuilt when this script, init or the kernel changes):
#   $EMBER_RDMA_VM_DIR/vmlinuz, $EMBER_RDMA_VM_DIR/initramfs.cpio
#   (default EMBER_RDMA_VM_DIR = <repo>/build/rdma-vm)
# Needs root for nothing but apt-get (scripts/install-deps.sh installs the
# host packages: qemu-system-x86 busybox-static kmod cpio iproute2).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${EMBER_RDMA_VM_DIR:-$REPO/build/rdma-vm}

# The kernel modules the guest loads: Soft-RoCE and what it silently needs
# (rdma_rxe computes the RoCEv2 ICRC through the crypto API's "crc32", which
# has no modules.dep edge, so crc32_generic is named here), the userspace
# verbs/CM interfaces, the dummy netdev rxe binds to, and 9p over virtio.
# crc32_pclmul is the faster "crc32" when the (emulated) CPU has PCLMULQDQ.
MODULES="crc32_generic crc32_pclmul rdma_rxe ib_uverbs rdma_ucm dummy virtio_pci 9pnet_virtio 9p"

reason=""
need() { command -v "$1" >/dev/null 2>&1 || reason="${reason:+$reason; }$1 not found (${2})"; }
need qemu-system-x86_64 "apt-get install qemu-system-x86"
need busybox "apt-get install busybox-static"
need cpio "apt-get install cpio"
need depmod "apt-get install kmod"
need modprobe "apt-get install kmod"
[[ -x /usr/bin/rdma ]] || reason="${reason:+$reason; }/usr/bin/rdma not found (apt-get install iproute2)"
[[ -x /usr/sbin/ip || -x /sbin/ip ]] || reason="${reason:+$reason; }ip not found (apt-get install iproute2)"
# a dynamic busybox would need its libraries inside the initramfs
if command -v busybox >/dev/null 2>&1 && ldd "$(command -v busybox)" >/dev/null 2>&1; then
  reason="${reason:+$reason; }busybox is not static (apt-get install busybox-static)"
fi
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}' || true)
if [[ -z $kpkg ]] && ! ls "$OUT"/kernel/*.deb >/dev/null 2>&1; then
  reason="${reason:+$reason; }cannot resolve the Debian kernel package linux-image-amd64 (run apt-get update)"
fi

if [[ ${1:-} == --check ]]; then
  if [[ -n $reason ]]; then echo "$reason"; exit 1; fi
  echo ok; exit 0
fi
if [[ -n $reason ]]; then echo "rdma-vm/image.sh: cannot build the guest: $reason" >&2; exit 1; fi

mkdir -p "$OUT/kernel"
# 1. the kernel package: downloaded once, unpacked, never installed.
deb=$(ls "$OUT"/kernel/"${kpkg:-linux-image-}"*_amd64.deb 2>/dev/null | head -n1 || true)
if [[ -z $deb ]]; then
  echo "rdma-vm: downloading $kpkg"
  (cd "$OUT/kernel" && apt-get download -q -o APT::Sandbox::User=root "$kpkg" >/dev/null)
  deb=$(ls "$OUT"/kernel/"$kpkg"_*_amd64.deb | head -n1)
fi
stamp="$(basename "$deb") $(cat "$HERE/image.sh" "$HERE/init" | sha256sum | cut -c1-16)"
if [[ -f $OUT/stamp && $(cat "$OUT/stamp") == "$stamp" && -f $OUT/vmlinuz && -f $OUT/initramfs.cpio ]]; then
  exit 0
fi
echo "rdma-vm: building the guest image in $OUT"
kroot=$OUT/kernel/root
rm -rf "$kroot"; mkdir -p "$kroot"
dpkg -x "$deb" "$kroot"
kver=$(ls "$kroot/lib/modules" | head -n1)
depmod -b "$kroot" "$kver"

# 2. the initramfs tree (merged /usr like Debian 12).
root=$OUT/root
rm -rf "$root"
mkdir -p "$root"/{usr/bin,usr/sbin,usr/lib/x86_64-linux-gnu,usr/lib64,etc,proc,sys,dev,tmp,run,newroot}
ln -s usr/bin "$root/bin"; ln -s usr/sbin "$root/sbin"; ln -s usr/lib "$root/lib"; ln -s usr/lib64 "$root/lib64"
cp "$(command -v busybox)" "$root/usr/bin/busybox"
for applet in $("$root/usr/bin/busybox" --list); do
  [[ -e $root/usr/bin/$applet ]] || ln -s busybox "$root/usr/bin/$applet"
done
ln -sf ../bin/busybox "$root/usr/sbin/modprobe"   # the kernel runs /sbin/modprobe to autoload

copy() {  # copy a host file (links followed) to the same path in the tree
  mkdir -p "$root$(dirname "$1")"; cp -L "$1" "$root$1"
}
copy_elf() {  # a dynamically linked program and the libraries ldd names
  copy "$1"
  ldd "$1" 2>/dev/null | awk '/=> \//{print $3} /^\t\/[^ ]*ld-linux/{print $1}' | while read -r lib; do
    [[ -e $root$lib ]] || copy "$lib"
  done
}
ipbin=/usr/sbin/ip; [[ -x $ipbin ]] || ipbin=/sbin/ip
copy_elf "$ipbin"; [[ $ipbin == /usr/sbin/ip ]] || { mkdir -p "$root/usr/sbin"; cp "$root$ipbin" "$root/usr/sbin/ip"; }
copy_elf /usr/bin/rdma

: > "$OUT/modules.list"
for m in $MODULES; do
  modprobe -d "$kroot" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" {print $2}' >> "$OUT/modules.list"
done
awk '!seen[$0]++' "$OUT/modules.list" | while read -r ko; do
  rel=${ko#"$kroot"}
  mkdir -p "$root$(dirname "$rel")"; cp "$ko" "$root$rel"
done
for f in modules.order modules.builtin modules.builtin.modinfo; do
  cp "$kroot/lib/modules/$kver/$f" "$root/lib/modules/$kver/"
done
depmod -b "$root" "$kver"

cp "$HERE/init" "$root/init"; chmod +x "$root/init"
echo "root:x:0:0:root:/root:/bin/sh" > "$root/etc/passwd"
echo "root:x:0:" > "$root/etc/group"
printf '/usr/lib/x86_64-linux-gnu\n' > "$root/etc/ld.so.conf"
ldconfig -r "$root" 2>/dev/null || true

cp "$kroot/boot/vmlinuz-$kver" "$OUT/vmlinuz"
(cd "$root" && find . | cpio -o -H newc --quiet) > "$OUT/initramfs.cpio.tmp"
mv "$OUT/initramfs.cpio.tmp" "$OUT/initramfs.cpio"
rm -rf "$kroot" "$root"
echo "$stamp" > "$OUT/stamp"
echo "rdma-vm: kernel $kver, initramfs $(du -h "$OUT/initramfs.cpio" | cut -f1)"
