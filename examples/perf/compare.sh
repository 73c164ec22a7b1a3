#!/bin/sh
# Compares our perftest-style examples with perftest's C tools on one RDMA device, alternating
# ours and perftest's (A B A B ...) so that drifts of the machine hit both alike, and prints the
# medians and their ratio.
#
# Usage: compare.sh EXAMPLES_DIR
#   EXAMPLES_DIR  where write_bw, write_lat, read_bw, send_bw and send_lat are (e.g.
#                 target/release/examples; build them with `cargo build --release --examples`).
# Environment (all optional):
#   IBVERBS_TEST_DEVICE (rxe0), IBVERBS_TEST_GID_INDEX (1)  device and GID index (-d, -x)
#   PAIRS (5)          A/B pairs per test (SoftRoCE latencies are bimodal from run to run:
#                      more pairs give steadier medians)
#   BW_SIZE (65536)    message size of the bandwidth tests;  BW_ITERS (5000) their iterations
#   LAT_SIZE (2)       message size of the latency tests;    LAT_ITERS (5000) their iterations
#   TESTS ("write_bw read_bw send_bw write_lat send_lat")   which tests
#   OURS_ARGS ("")     extra flags for our examples (e.g. --raw or --safe)
#   RUN_TIMEOUT (180)  seconds one client or server may run
#   PIN (1)            with 1 and at least two CPUs, servers run on CPU 1 and clients on CPU 0
#                      (taskset), for both tools; 0 leaves the placement to the scheduler
#
# Metrics: bandwidth tests compare the client's "BW average[MB/sec]" (higher is better), latency
# tests the client's "t_typical[usec]" (the median; lower is better). ratio = ours / perftest.
# Run it where a device exists, e.g.
#   cargo xtask rxe --timeout 900 -- sh examples/perf/compare.sh target/release/examples
set -u

dir=${1:?usage: compare.sh EXAMPLES_DIR}
dev=${IBVERBS_TEST_DEVICE:-rxe0}
gid=${IBVERBS_TEST_GID_INDEX:-1}
pairs=${PAIRS:-5}
bw_size=${BW_SIZE:-65536}
bw_iters=${BW_ITERS:-5000}
lat_size=${LAT_SIZE:-2}
lat_iters=${LAT_ITERS:-5000}
tests=${TESTS:-write_bw read_bw send_bw write_lat send_lat}
ours_args=${OURS_ARGS:-}
run_timeout=${RUN_TIMEOUT:-180}
pin=${PIN:-1}

for t in $tests; do
    [ -x "$dir/$t" ] || { echo "compare.sh: $dir/$t not found (cargo build --release --examples)" >&2; exit 2; }
    command -v "ib_$t" >/dev/null || { echo "compare.sh: ib_$t (perftest) not found" >&2; exit 2; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
port=19000

# shellcheck source=examples/perf/pair.sh
. "$(dirname "$0")/pair.sh"
# The same placement for both tools (see PIN): "taskset -c N" prefixes, or none.
pin_setup "$pin"

# metric TEST FILE: the client's figure of interest from a result table.
metric() {
    case $1 in
    *_bw) awk '/#bytes/ { if (getline > 0) { print $4; exit } }' "$2" ;;
    *) awk '/#bytes/ { if (getline > 0) { print $5; exit } }' "$2" ;;
    esac
}

# run_pair KIND TEST SIZE ITERS PORT: one server + client run of ours (KIND=ours) or perftest's;
# prints the metric, or nothing on failure (runs in a subshell: failures leave a mark in $work).
run_pair() {
    kind=$1 t=$2 size=$3 iters=$4 port=$5
    if [ "$kind" = ours ]; then
        bin="$dir/$t"
        extra=$ours_args
    else
        bin="ib_$t"
        extra=
    fi
    # shellcheck disable=SC2086 # $extra is a list of flags
    pair_run "$kind" 40 "$srv_pin" "$cli_pin" "$bin" -d "$dev" -x "$gid" -s "$size" -n "$iters" -p "$port" $extra
    if [ $rc -ne 0 ] || [ $src -ne 0 ]; then
        {
            echo "compare.sh: $kind $t failed (client $rc, server $src)"
            tail -5 "$work/client"
            tail -5 "$work/server"
        } >&2
        : >"$work/failed"
        return
    fi
    metric "$t" "$work/client"
}

median() {
    tr ' ' '\n' | awk 'NF { v[n++] = $1 } END {
        if (n == 0) { print "-"; exit }
        for (i = 1; i < n; i++) { x = v[i]; j = i - 1; while (j >= 0 && v[j] > x) { v[j + 1] = v[j]; j-- } v[j + 1] = x }
        if (n % 2) printf "%.2f\n", v[int(n / 2)]; else printf "%.2f\n", (v[n / 2 - 1] + v[n / 2]) / 2 }'
}

: >"$work/table"
for t in $tests; do
    case $t in
    *_bw) size=$bw_size iters=$bw_iters ;;
    *) size=$lat_size iters=$lat_iters ;;
    esac
    ours=
    theirs=
    i=1
    while [ "$i" -le "$pairs" ]; do
        a=$(run_pair ours "$t" "$size" "$iters" $((port + 1)))
        b=$(run_pair perftest "$t" "$size" "$iters" $((port + 2)))
        port=$((port + 2))
        echo "$t size $size pair $i: ours ${a:-FAILED} perftest ${b:-FAILED}"
        ours="$ours $a"
        theirs="$theirs $b"
        i=$((i + 1))
    done
    mo=$(echo "$ours" | median)
    mp=$(echo "$theirs" | median)
    ratio=$(awk -v a="$mo" -v b="$mp" 'BEGIN { if (a == "-" || b == "-" || b == 0) print "-"; else printf "%.2f", a / b }')
    echo "$t $size $mo $mp $ratio" >>"$work/table"
done

echo
echo "bandwidth: BW average [MB/sec], higher is better; latency: t_typical [usec], lower is better"
printf '%-10s %8s %14s %16s %7s\n' test size "ours median" "perftest median" ratio
while read -r t size mo mp ratio; do
    printf '%-10s %8s %14s %16s %7s\n' "$t" "$size" "$mo" "$mp" "$ratio"
done <"$work/table"
[ ! -e "$work/failed" ]
