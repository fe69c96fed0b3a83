#!/usr/bin/env bash
# Boot the soft-RoCE test VM (building it first if needed, see build-image.sh), run a command in
# the guest inside a copy of this pycoll tree, print its output, and exit with its exit code.
#   tests/rdma/run-vm.sh                     # the default: tests/rdma/guest-tests.sh (tests + bench)
#   tests/rdma/run-vm.sh 'python3 -m pytest -q tests/test_verbs.py'
# Environment: PYCOLL_RDMA_CACHE (image cache), PYCOLL_RDMA_OUT (where guest.log/console.log go,
# default a fresh temporary folder), PYCOLL_RDMA_TIMEOUT (seconds, default 1500),
# PYCOLL_RDMA_MEM (MiB, default 3072), PYCOLL_RDMA_CPUS (default 2), PYCOLL_RDMA_ACCEL (auto|kvm|tcg).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${PYCOLL_RDMA_CACHE:-/var/cache/pycoll-rdma}"
bash "$HERE/build-image.sh"
OUT="${PYCOLL_RDMA_OUT:-$(mktemp -d /tmp/pycoll-rdma-vm.XXXXXX)}"
mkdir -p "$OUT"
rm -f "$OUT/rc" "$OUT/guest.log"
echo "${1:-sh tests/rdma/guest-tests.sh}" >"$OUT/cmd.sh"
# KVM needs VT-x/AMD-V in the host kernel (kvm_intel/kvm_amd). A /dev/kvm served by kvm_pvm (the
# PVM nested hypervisor of some cloud sandboxes) only runs PVM-enabled guest kernels, which Debian's
# is not: it hangs right after the BIOS. Then emulate (TCG): about 5-10x slower, same results.
ACCEL_KIND="${PYCOLL_RDMA_ACCEL:-auto}"
if [[ "$ACCEL_KIND" == auto ]]; then
    ACCEL_KIND=tcg
    if [[ -w /dev/kvm ]] && [[ -d /sys/module/kvm_intel || -d /sys/module/kvm_amd ]]; then ACCEL_KIND=kvm; fi
fi
if [[ "$ACCEL_KIND" == kvm ]]; then
    ACCEL=(-machine q35,accel=kvm -cpu host)
else
    echo "run-vm: no VT-x/AMD-V KVM here (see run-vm.sh): emulating the VM with TCG" >&2
    ACCEL=(-machine q35 -accel tcg,thread=multi -cpu max)
fi
echo "run-vm: booting the VM (output in $OUT)"
start=$(date +%s)
set +e
timeout "${PYCOLL_RDMA_TIMEOUT:-1500}" nice -n 10 qemu-system-x86_64 "${ACCEL[@]}" \
    -smp "${PYCOLL_RDMA_CPUS:-2}" -m "${PYCOLL_RDMA_MEM:-3072}" -nographic -no-reboot \
    -kernel "$CACHE/vmlinuz" -initrd "$CACHE/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 init=/sbin/pycoll-guest-init net.ifnames=0 quiet panic=-1 no_timer_check" \
    -drive "file=$CACHE/root.img,format=raw,if=virtio,snapshot=on" \
    -virtfs "local,path=$REPO,mount_tag=src,security_model=none,readonly=on" \
    -virtfs "local,path=$OUT,mount_tag=out,security_model=none" \
    -netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0 \
    </dev/null >"$OUT/console.log" 2>&1
qrc=$?
set -e
cat "$OUT/guest.log" 2>/dev/null || true
echo "run-vm: the VM ran $(( $(date +%s) - start )) s"
if [[ ! -f "$OUT/rc" ]]; then
    echo "run-vm: the guest left no exit code (qemu exit $qrc); console:" >&2
    tail -40 "$OUT/console.log" >&2
    exit 1
fi
exit "$(cat "$OUT/rc")"
