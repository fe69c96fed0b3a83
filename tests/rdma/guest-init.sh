#!/bin/sh
# Inside the test VM, as PID 1 (started by /sbin/pycoll-guest-init from the image): bring up
# soft-RoCE (rdma_rxe over eth0), copy the shared pycoll tree to a writable place, run the host's
# /out/cmd.sh there, leave its output in /out/guest.log and its exit code in /out/rc, power off.
# The kernel command line may give eth0's address and the hostname (run-vm-pair.sh does:
# pycoll.addr=10.9.0.1/24 pycoll.name=pycoll-rdma-vm0); else 10.0.2.15/24 and pycoll-rdma-vm.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /out /dev/shm /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t devpts devpts /dev/pts
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out /out
say() { echo "guest: $*"; echo "guest: $*" >>/out/guest.log; }
finish() {
    echo "$1" >/out/rc
    sync
    umount /out
    echo o >/proc/sysrq-trigger  # power off at once (no init system to ask)
    sleep 30
}
: >/out/guest.log
addr=10.0.2.15/24 name=pycoll-rdma-vm
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        pycoll.addr=*) addr="${arg#pycoll.addr=}" ;;
        pycoll.name=*) name="${arg#pycoll.name=}" ;;
    esac
done
hostname "$name"
modprobe virtio_net 2>>/out/guest.log
i=0
until [ -e /sys/class/net/eth0 ]; do  # the NIC appears asynchronously after the module loads
    i=$((i + 1)); [ $i -gt 100 ] && { say "no eth0: $(ls /sys/class/net)"; finish 93; }
    sleep 0.1
done
modprobe rdma_rxe || { say "no rdma_rxe module in this kernel"; finish 90; }
modprobe ib_uverbs
ip link set lo up
ip link set eth0 up
# The NIC is on an isolated qemu network: user-mode with restrict=on (one VM: verbs traffic between
# ranks on rxe0 never leaves the guest, rxe loops it back internally) or the pair's link (run-vm-pair.sh).
ip addr add "$addr" dev eth0
rdma link add rxe0 type rxe netdev eth0 || { say "rdma link add failed"; finish 91; }
i=0
until ibv_devinfo -d rxe0 2>/dev/null | grep -q PORT_ACTIVE; do
    i=$((i + 1)); [ $i -gt 50 ] && { say "rxe0 port never became active"; ibv_devinfo >>/out/guest.log 2>&1; finish 92; }
    sleep 0.1
done
say "soft-RoCE up on $name ($addr): $(rdma link show | tr '\n' ' ')"
ulimit -l unlimited
mkdir -p /root/pycoll
(cd /src && tar --exclude=.git --exclude='*.pyc' --exclude=__pycache__ -cf - .) | tar -xf - -C /root/pycoll
cd /root/pycoll
export PYTHONPATH=/opt/pycoll-py:/root/pycoll PYTHONDONTWRITEBYTECODE=1 PATH=/opt/pycoll-py/bin:$PATH
sh /out/cmd.sh >>/out/guest.log 2>&1
finish $?
