#!/usr/bin/env bash
# Boot the soft-RoCE test VM (building it first if needed, see build-image.sh), run a command in
# the guest inside a copy of this pycoll tree, print its output, and exit with its exit code.
#   tests/rdma/run-vm.sh                     # the default: tests/rdma/guest-tests.sh (tests + bench)
#   tests/rdma/run-vm.sh 'python3 -m pytest -q tests/test_verbs.py'
# Environment: PYCOLL_RDMA_CACHE (image cache), PYCOLL_RDMA_OUT (where guest.log/console.log go,
# default a fresh temporary folder), PYCOLL_RDMA_TIMEOUT (seconds, default 1500),
# PYCOLL_RDMA_MEM (MiB, default 3072), PYCOLL_RDMA_CPUS (default 2), PYCOLL_RDMA_ACCEL (auto|kvm|tcg).
# Two VMs on one link: run-vm-pair.sh.
set -euo pipefail
source "$(dirname "$0")/vm-common.sh"
OUT="${PYCOLL_RDMA_OUT:-$(mktemp -d /tmp/pycoll-rdma-vm.XXXXXX)}"
mkdir -p "$OUT"
rm -f "$OUT/rc" "$OUT/guest.log"
echo "${1:-sh tests/rdma/guest-tests.sh}" >"$OUT/cmd.sh"
trap 'stop_vm "$OUT"' EXIT
trap 'exit 143' TERM INT
echo "run-vm: booting the VM (output in $OUT)"
start=$(date +%s)
set +e
# user-mode networking with restrict=on: nothing leaves the VM
boot_vm "$OUT" "${PYCOLL_RDMA_MEM:-3072}" "" -netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0
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
