#!/usr/bin/env bash
# Boot two soft-RoCE VMs whose NICs share one Ethernet link, run a command in both (each in a copy of
# this pycoll tree), print both outputs, and exit 0 only if both commands did.
#   tests/rdma/run-vm-pair.sh                 # default: tests/rdma/guest-pair.sh (summary, tests, bench)
#   tests/rdma/run-vm-pair.sh 'python3 -m pytest -q tests/test_verbs_hosts.py -k collective'
# The link is a pair of qemu dgram netdevs: each VM's NIC sends its Ethernet frames as UDP datagrams
# from its port on 127.0.0.1 to the other's, so they travel over this machine's loopback only. (A
# socket netdev's TCP stream between the two qemus held small frames back, Nagle against delayed
# ACKs: 8-byte round trips took 40-80 ms.) VM n has eth0 10.9.0.(n+1)/24 with rxe0 on
# it, hostname pycoll-rdma-vm<n>, and in its command's environment PYCOLL_RDMA_PAIR="n,10.9.0.1" and
# one PYCOLL_JOB_TOKEN shared by both. Environment as run-vm.sh's; PYCOLL_RDMA_MEM is per VM (default
# here 2048: a VM runs at most 2 ranks), and both VMs must fit in the memory available now;
# PYCOLL_RDMA_TIMEOUT defaults to 3000 s here.
set -euo pipefail
source "$(dirname "$0")/vm-common.sh"
OUT="${PYCOLL_RDMA_OUT:-$(mktemp -d /tmp/pycoll-rdma-pair.XXXXXX)}"
MEM="${PYCOLL_RDMA_MEM:-2048}"
export PYCOLL_RDMA_TIMEOUT="${PYCOLL_RDMA_TIMEOUT:-3000}"  # boot_vm's limit: 16 min quiet, 40 at load 20
avail=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
if (( avail < 2 * MEM + 512 )); then
    echo "run-vm-pair: two VMs of $MEM MiB need $(( 2 * MEM + 512 )) MiB with room to spare; $avail MiB are" \
         "available (free -m); set PYCOLL_RDMA_MEM lower" >&2
    exit 1
fi
CMD="${1:-sh tests/rdma/guest-pair.sh}"
TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
read -r PORT0 PORT1 < <(python3 -c '
import random, socket
low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
ports = []
while len(ports) < 2:  # UDP ports below the ephemeral range: only ever bound on purpose
    port = random.randrange(max(1024, low - 12000), low)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    ports.append(port)
print(*ports)')
for n in 0 1; do
    mkdir -p "$OUT/vm$n"
    rm -f "$OUT/vm$n/rc" "$OUT/vm$n/guest.log"
    printf 'export PYCOLL_RDMA_PAIR=%s,10.9.0.1 PYCOLL_JOB_TOKEN=%s\n%s\n' "$n" "$TOKEN" "$CMD" >"$OUT/vm$n/cmd.sh"
done
trap 'stop_vm "$OUT/vm0"; stop_vm "$OUT/vm1"' EXIT
trap 'exit 143' TERM INT
echo "run-vm-pair: booting two VMs of $MEM MiB, linked over 127.0.0.1 UDP ports $PORT0 and $PORT1 (output in $OUT)"
start=$(date +%s)
link() {  # link FROM TO: frames from 127.0.0.1:FROM to 127.0.0.1:TO
    echo "dgram,id=n0,local.type=inet,local.host=127.0.0.1,local.port=$1,remote.type=inet,remote.host=127.0.0.1,remote.port=$2"
}
nic() { echo "virtio-net-pci,netdev=n0,mac=52:54:00:9a:00:0$1"; }
boot_vm "$OUT/vm0" "$MEM" "pycoll.addr=10.9.0.1/24 pycoll.name=pycoll-rdma-vm0" \
    -netdev "$(link "$PORT0" "$PORT1")" -device "$(nic 1)" &
vm0=$!
boot_vm "$OUT/vm1" "$MEM" "pycoll.addr=10.9.0.2/24 pycoll.name=pycoll-rdma-vm1" \
    -netdev "$(link "$PORT1" "$PORT0")" -device "$(nic 2)" &
vm1=$!
set +e
wait "$vm0"
wait "$vm1"
set -e
rc=0
for n in 0 1; do
    echo "=================== VM $n (pycoll-rdma-vm$n) ==================="
    cat "$OUT/vm$n/guest.log" 2>/dev/null || true
    if [[ ! -f "$OUT/vm$n/rc" ]]; then
        echo "run-vm-pair: VM $n left no exit code; its console:" >&2
        tail -40 "$OUT/vm$n/console.log" >&2
        rc=1
    elif [[ "$(cat "$OUT/vm$n/rc")" != 0 ]]; then
        rc=1
    fi
done
echo "run-vm-pair: the VMs ran $(( $(date +%s) - start )) s; exit codes $(cat "$OUT"/vm0/rc 2>/dev/null || echo -)" \
     "$(cat "$OUT"/vm1/rc 2>/dev/null || echo -)"
exit "$rc"
