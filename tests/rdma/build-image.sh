#!/usr/bin/env bash
# Build (once) the soft-RoCE test VM: a Debian bookworm root file system made with debootstrap, with
# Debian's generic kernel (linux-image-amd64: it ships rdma_rxe, the -cloud flavour does not),
# rdma-core's user space and python3-pyverbs, and pycoll's pip dependencies for the guest's
# Python 3.11. Output in $PYCOLL_RDMA_CACHE (default /var/cache/pycoll-rdma), never in the repo:
#   vmlinuz  initrd.img  root.img (ext4, booted read-only-ish with qemu snapshot=on)  stamp
# Rebuilds only when this script changes (the stamp holds its hash). Needs root (debootstrap).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${PYCOLL_RDMA_CACHE:-/var/cache/pycoll-rdma}"
STAMP="$(sha256sum "$HERE/build-image.sh" | cut -c1-16)"
if [[ -f "$CACHE/stamp" && "$(cat "$CACHE/stamp")" == "$STAMP" ]]; then
    echo "build-image: cached image in $CACHE is current"; exit 0
fi
NICE="nice -n 10"
mkdir -p "$CACHE"

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
if ((${#need[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $NICE apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The Debian mirror this machine already uses (from its apt sources), so nothing else is contacted.
MIRROR="${PYCOLL_RDMA_MIRROR:-$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' \
    /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}"
MIRROR="${MIRROR:-$(awk '/^deb / && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)}"
[[ -n "$MIRROR" ]] || { echo "build-image: no Debian mirror in the apt sources; set PYCOLL_RDMA_MIRROR" >&2; exit 1; }

ROOT="$CACHE/rootfs.tmp"
rm -rf "$ROOT"
PKGS=linux-image-amd64,initramfs-tools,kmod,iproute2,procps,python3,python3-pyverbs,rdma-core,ibverbs-providers,ibverbs-utils,libibverbs1
echo "build-image: debootstrap bookworm from $MIRROR (a few minutes)"
$NICE debootstrap --variant=minbase --include="$PKGS" bookworm "$ROOT" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -30 "$CACHE/debootstrap.log" >&2; exit 1; }

# Boot straight into our init (no systemd): the initramfs only needs virtio disk, ext4 and 9p.
printf '%s\n' virtio_pci virtio_blk ext4 9p 9pnet_virtio >>"$ROOT/etc/initramfs-tools/modules"
chroot "$ROOT" /bin/sh -c 'update-initramfs -u -k all' >>"$CACHE/debootstrap.log" 2>&1
cat >"$ROOT/sbin/pycoll-guest-init" <<'INIT'
#!/bin/sh
# PID 1 of the test VM: mount the shared pycoll tree, then run its guest-init.sh (which can change
# without rebuilding this image).
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sys /sys
mountpoint -q /dev || mount -t devtmpfs dev /dev
modprobe 9pnet_virtio; modprobe 9p
mkdir -p /src && mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144 src /src
exec /bin/sh /src/tests/rdma/guest-init.sh
INIT
chmod 755 "$ROOT/sbin/pycoll-guest-init"
echo pycoll-rdma-vm >"$ROOT/etc/hostname"
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*

# pycoll's pure-pip dependencies (bookworm's pyzmq is too old), as wheels for the guest's CPython 3.11.
echo "build-image: pip wheels for the guest (numpy, pyzmq, ml_dtypes, pytest, pytest-timeout)"
$NICE python3 -m pip install -q --target "$ROOT/opt/pycoll-py" --only-binary=:all: \
    --python-version 3.11 --implementation cp --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "numpy>=1.22,<2.3" "pyzmq>=26.4" "ml_dtypes>=0.3" "pytest>=7" "pytest-timeout>=2"

cp "$ROOT"/boot/vmlinuz-* "$CACHE/vmlinuz"
cp "$ROOT"/boot/initrd.img-* "$CACHE/initrd.img"
rm -f "$CACHE/root.img"
$NICE mkfs.ext4 -q -L pycoll-root -d "$ROOT" "$CACHE/root.img" 3G
rm -rf "$ROOT"
echo "$STAMP" >"$CACHE/stamp"
echo "build-image: done: $(ls -sh "$CACHE"/vmlinuz "$CACHE"/initrd.img "$CACHE"/root.img | tr '\n' ' ')"
