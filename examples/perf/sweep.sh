#!/bin/sh
# Size and scaling sweeps of our perftest-style examples at both posting levels against
# perftest's C tools on one RDMA device, alternating the three (safe, raw, perftest) within each
# round, in an order rotated from round to round, so that drifts of the machine hit all alike.
# Prints one machine-readable line per run;
# `cargo xtask bench --sweep` turns them into tables, a JSON file and plots.
#
# Usage: sweep.sh EXAMPLES_DIR
#   EXAMPLES_DIR  where write_bw, write_lat, read_bw, send_bw and send_lat are (release build).
# Environment (all optional):
#   IBVERBS_TEST_DEVICE (rxe0), IBVERBS_TEST_GID_INDEX (1)  device and GID index (-d, -x)
#   PAIRS (3)        rounds (each runs safe, raw and perftest once) per point
#   TARGET_SIZES ("2 4096 65536"), TARGET_PAIRS (PAIRS)   sizes of the size sweep that get
#                    TARGET_PAIRS rounds instead (the points of the safe level's targets)
#   SIZES ("2 64 1024 4096 65536 1048576")   message sizes of the size sweep
#   TESTS ("write_bw read_bw send_bw write_lat send_lat")   tests of the size sweep
#   QPS ("1 2 4 8 16 32 64")   queue pair counts of the scaling sweep (write_bw, 64 B messages)
#   RUN_TIMEOUT (120)  seconds one client or server may run
#   PIN (1)          with 1 and at least two CPUs, every tool's server runs on CPU 1 and its
#                    client on CPU 0 (taskset): on SoftRoCE both spin, and where the scheduler
#                    puts them moves a 2 B latency by up to a third from run to run; 0 leaves
#                    the placement to the scheduler
#
# Output lines (values: bandwidth tests the client's "MsgRate[Mpps]" as MB/s, message rate x size
# / 2^20, which is its "BW average[MB/sec]" with more digits; latency tests its
# "t_typical[usec]"; the scaling sweep the client's "MsgRate[Mpps]"):
#   SWEEP TEST KIND SIZE ROUND rc=RC VALUE      KIND: safe | raw | perftest
#   SCALE write_bw KIND QPS ROUND rc=RC VALUE
#   RETRY KIND TEST rc=RC -                     (a failed run, run once more)
# Run it where a device exists, e.g.
#   cargo xtask rxe --timeout 3600 -- sh examples/perf/sweep.sh target/release/examples
set -u

dir=${1:?usage: sweep.sh EXAMPLES_DIR}
dev=${IBVERBS_TEST_DEVICE:-rxe0}
gid=${IBVERBS_TEST_GID_INDEX:-1}
pairs=${PAIRS:-3}
target_sizes=${TARGET_SIZES:-2 4096 65536}
target_pairs=${TARGET_PAIRS:-$pairs}
sizes=${SIZES:-2 64 1024 4096 65536 1048576}
tests=${TESTS:-write_bw read_bw send_bw write_lat send_lat}
qps_list=${QPS:-1 2 4 8 16 32 64}
run_timeout=${RUN_TIMEOUT:-120}
pin=${PIN:-1}

for t in $tests write_bw; do
    [ -x "$dir/$t" ] || { echo "sweep.sh: $dir/$t not found (cargo build --release --examples)" >&2; exit 2; }
    command -v "ib_$t" >/dev/null || { echo "sweep.sh: ib_$t (perftest) not found" >&2; exit 2; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
port=20000
failed=0

# shellcheck source=examples/perf/pair.sh
. "$(dirname "$0")/pair.sh"
# The same placement for every tool (see PIN): "taskset -c N" prefixes, or none.
pin_setup "$pin"
echo "PIN server=${srv_pin:-none} client=${cli_pin:-none}"

# metric TEST COLUMN FILE: a column of the first row after the client's result table header.
metric() {
    awk -v c="$2" '/#bytes/ { if (getline > 0) { print $c; exit } }' "$3"
}

# iters TEST SIZE: iterations per run: 32 MiB of messages (bandwidth tests) or 16 MiB (latency
# tests), at most 20 000 (10 000): the small sizes' runs last a fraction of a second, not a few
# milliseconds, whose figures a run's start and the host's noise moved by more than the 3 % the
# targets ask (2 B write_bw with 2000 iterations: the same tool 0.058-0.071 MB/s from round to
# round); at least the send queue depth, 128, for bandwidth tests (perftest requires it).
iters() {
    case $1 in
    *_bw) n=$((33554432 / $2)); [ $n -gt 20000 ] && n=20000; [ $n -lt 128 ] && n=128 ;;
    *) n=$((16777216 / $2)); [ $n -gt 10000 ] && n=10000; [ $n -lt 50 ] && n=50 ;;
    esac
    echo $n
}

# run KIND TEST COLUMN ARGS...: one server + client run; sets res to "rc=RC VALUE" (VALUE "-" on
# failure). Called in this shell (not a subshell), so that the port and the failure mark persist.
run() {
    kind=$1 t=$2 col=$3
    shift 3
    port=$((port + 1))
    case $kind in
    safe) bin="$dir/$t" extra=--safe ;;
    raw) bin="$dir/$t" extra=--raw ;;
    *) bin="ib_$t" extra= ;;
    esac
    # shellcheck disable=SC2086 # $extra is one flag or none
    pair_run "$kind" 40 "$srv_pin" "$cli_pin" "$bin" -d "$dev" -x "$gid" -p "$port" $extra "$@"
    [ $rc -eq 0 ] && rc=$src
    v=-
    if [ $rc -eq 0 ]; then
        v=$(metric "$t" "$col" "$work/client")
        # No value, or not a finite number (perftest's write_lat has printed "inf" as its
        # typical latency): a failed run, run once more.
        case $v in
        '' | *[!0-9.]* | *.*.*) v=-; rc=1 ;;
        esac
    fi
    if [ $rc -ne 0 ]; then
        {
            echo "sweep.sh: $kind $t $* failed (exit $rc)"
            tail -3 "$work/client"
            tail -3 "$work/server"
        } >&2
    fi
    res="rc=$rc $v"
}

# run_retry ARGS...: run, and once more if that failed (either tool fails now and then on a
# loaded SoftRoCE host); a RETRY line records the first failure.
run_retry() {
    run "$@"
    case $res in
    rc=0*) ;;
    *)
        echo "RETRY $1 $2 $res"
        run "$@"
        case $res in rc=0*) ;; *) failed=1 ;; esac
        ;;
    esac
}

# to_mbs "rc=RC MPPS" SIZE: "rc=RC MB/s" (2^20 bytes, as perftest's BW columns) from the message
# rate, which the tools print with 6 decimals where their BW columns have 2 (0.02 MB/s at 2 B:
# a ratio of such values says nothing).
to_mbs() {
    echo "$1" | awk -v s="$2" '$2 == "-" { print; next } { printf "%s %.6f\n", $1, $2 * 1000000 * s / 1048576 }'
}

# kinds ROUND: the three tools in round ROUND's order, rotated from round to round so that no
# tool always runs first (or right after the same one): what comes with a place in the order
# (the first run after a size change, the page cache, the previous tool's teardown) is shared.
kinds() {
    case $((($1 - 1) % 3)) in
    0) echo safe raw perftest ;;
    1) echo raw perftest safe ;;
    *) echo perftest safe raw ;;
    esac
}

for t in $tests; do
    # Bandwidth tests: the message rate (column 5), turned into MB/s by to_mbs.
    col=5
    for size in $sizes; do
        n=$(iters "$t" "$size")
        rounds=$pairs
        case " $target_sizes " in *" $size "*) rounds=$target_pairs ;; esac
        i=1
        while [ "$i" -le "$rounds" ]; do
            for kind in $(kinds "$i"); do
                run_retry "$kind" "$t" "$col" -s "$size" -n "$n"
                case $t in *_bw) res=$(to_mbs "$res" "$size") ;; esac
                echo "SWEEP $t $kind $size $i $res"
            done
            i=$((i + 1))
        done
    done
done

for q in $qps_list; do
    i=1
    while [ "$i" -le "$pairs" ]; do
        for kind in $(kinds "$i"); do
            run_retry "$kind" write_bw 5 -s 64 -n 1000 -q "$q"
            echo "SCALE write_bw $kind $q $i $res"
        done
        i=$((i + 1))
    done
done
exit $failed
