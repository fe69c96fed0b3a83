#!/bin/sh
# Runs inside the soft-RoCE VM (run-vm.sh's default command), from a copy of the pycoll tree:
# the verbs tests on rxe0, then pycoll bench allreduce over verbs and over tcp in this same VM,
# and the side-by-side busbw table. Exit code 0 only if the tests passed and both benches ran.
# PYCOLL_RDMA_PYTEST_ARGS adds pytest arguments (e.g. "-k p2p"); PYCOLL_RDMA_BENCH=0 skips the bench.
set -u
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -m pycoll "$@"\n' >/tmp/bin/pycoll
chmod +x /tmp/bin/pycoll
export PATH=/tmp/bin:$PATH
rc=0
echo "== verbs tests on $(ls /sys/class/infiniband) ($(nproc) vCPUs)"
start=$(date +%s)
# shellcheck disable=SC2086
python3 -m pytest -p no:cacheprovider -rs -v tests/test_verbs.py ${PYCOLL_RDMA_PYTEST_ARGS:-} || rc=1
echo "== tests took $(( $(date +%s) - start )) s"
if [ "${PYCOLL_RDMA_BENCH:-1}" != 0 ]; then
    for t in verbs tcp; do
        echo "== pycoll bench allreduce over $t: 2 ranks in this VM"
        start=$(date +%s)
        pycoll run -n 2 pycoll bench allreduce -b 8 -e 16M -f 4 -n "${PYCOLL_RDMA_ITERS:-10}" \
            --transport "$t" --json "/tmp/bench-$t.json" || rc=1
        echo "== bench over $t took $(( $(date +%s) - start )) s"
    done
    python3 tests/rdma/compare_bench.py /tmp/bench-verbs.json /tmp/bench-tcp.json || rc=1
    cp /tmp/bench-*.json /out/ 2>/dev/null
fi
echo "== guest-tests exit code $rc"
exit $rc
