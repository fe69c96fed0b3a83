# Sourced by run-vm.sh and run-vm-pair.sh: builds the image if needed, picks KVM or TCG, and defines
# boot_vm, which runs one VM of the image until it powers off (or PYCOLL_RDMA_TIMEOUT passes).
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${PYCOLL_RDMA_CACHE:-/var/cache/pycoll-rdma}"
bash "$HERE/build-image.sh"
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
    echo "run-vm: no VT-x/AMD-V KVM here (see vm-common.sh): emulating the VM with TCG" >&2
    ACCEL=(-machine q35 -accel tcg,thread=multi -cpu max)
fi

# boot_vm OUT MEM_MIB KERNEL_ARGS QEMU_ARGS...: the VM sees this tree read-only over 9p (tag src) and
# OUT read-write (tag out: cmd.sh in, guest.log and rc out); QEMU_ARGS add its NIC. The pid of its
# `timeout` (which passes a TERM on to qemu) is in OUT/vm.pid, for stop_vm.
boot_vm() {
    local out="$1" mem="$2" extra="$3"
    shift 3
    timeout "${PYCOLL_RDMA_TIMEOUT:-1500}" nice -n 10 qemu-system-x86_64 "${ACCEL[@]}" \
        -smp "${PYCOLL_RDMA_CPUS:-2}" -m "$mem" -nographic -no-reboot \
        -kernel "$CACHE/vmlinuz" -initrd "$CACHE/initrd.img" \
        -append "root=/dev/vda rw console=ttyS0 init=/sbin/pycoll-guest-init net.ifnames=0 quiet panic=-1 no_timer_check $extra" \
        -drive "file=$CACHE/root.img,format=raw,if=virtio,snapshot=on" \
        -virtfs "local,path=$REPO,mount_tag=src,security_model=none,readonly=on" \
        -virtfs "local,path=$out,mount_tag=out,security_model=none" \
        "$@" </dev/null >"$out/console.log" 2>&1 &
    echo $! >"$out/vm.pid"
    wait $!
}

# stop_vm OUT: end the VM that boot_vm OUT started, if it still runs (for traps on the way out).
stop_vm() {
    if [[ -f "$1/vm.pid" ]]; then
        kill "$(cat "$1/vm.pid")" 2>/dev/null || true
        rm -f "$1/vm.pid"
    fi
}
