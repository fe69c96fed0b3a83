#!/bin/sh
# Runs inside each of the two soft-RoCE VMs (run-vm-pair.sh's default command), from a copy of the
# pycoll tree, with PYCOLL_RDMA_PAIR="NODE,VM0_ADDRESS" and the job token shared by both VMs:
#   1. the summary: `pycoll info` on 4 ranks, 2 per VM (which transport carries each pair);
#   2. tests/test_verbs_hosts.py, in lockstep with the other VM (each runs its share of every job;
#      -rP shows what the passing failure tests measured);
#   3. the bench: allreduce and broadcast over verbs, tcp and auto, 2 ranks, one per VM (pair_bench.py).
# Exit code 0 only if all three did. PYCOLL_RDMA_PYTEST_ARGS adds pytest arguments (both VMs must
# get the same); PYCOLL_RDMA_BENCH=0 skips the bench.
set -u
node=${PYCOLL_RDMA_PAIR%%,*}
master=${PYCOLL_RDMA_PAIR#*,}
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -m pycoll "$@"\n' >/tmp/bin/pycoll
chmod +x /tmp/bin/pycoll
export PATH=/tmp/bin:$PATH
job() {  # job PORT ARGS...: one pycoll run over both VMs
    port=$1
    shift
    pycoll run --nnodes 2 --node-rank "$node" --master-addr "$master" --master-port "$port" --timeout 900 "$@"
}
rc=0
echo "== VM $node: $(hostname), eth0 $(ip -4 -o addr show eth0 | awk '{print $4}'), $(ls /sys/class/infiniband)," \
     "$(nproc) vCPUs, $(free -m | awk '/^Mem:/ {print $2}') MiB"
echo "== which transport carries each pair: pycoll info, 4 ranks (2 per VM)"
start=$(date +%s)
job 29400 -n 2 pycoll info --collective allreduce --sizes 8,64K,1M,16M || rc=1
echo "== summary took $(( $(date +%s) - start )) s"
echo "== tests/test_verbs_hosts.py (ranks split over both VMs)"
start=$(date +%s)
# shellcheck disable=SC2086
python3 -m pytest -p no:cacheprovider -rsP -v tests/test_verbs_hosts.py ${PYCOLL_RDMA_PYTEST_ARGS:-} || rc=1
echo "== tests took $(( $(date +%s) - start )) s"
if [ "${PYCOLL_RDMA_BENCH:-1}" != 0 ]; then
    echo "== bench: verbs, tcp and auto between the VMs, 2 ranks (one per VM), side by side"
    start=$(date +%s)
    job 29410 -n 1 python3 tests/rdma/pair_bench.py --json /tmp/pair-bench.json || rc=1
    [ "$node" = 0 ] && cp /tmp/pair-bench.json /out/ 2>/dev/null
    echo "== bench took $(( $(date +%s) - start )) s"
fi
echo "== rxe0 counters (retries and sequence errors say whether the emulated link lost packets):" \
     "$(cd /sys/class/infiniband/rxe0/ports/1/hw_counters && for c in *; do printf '%s=%s ' "$c" "$(cat "$c")"; done)"
echo "== eth0: $(ip -s -o link show eth0 | tr -s ' ' | cut -c1-400)"
echo "== memory at the end: $(free -m | awk '/^Mem:/ {print $3 " MiB used of " $2}')"
echo "== guest-pair exit code $rc"
exit $rc
