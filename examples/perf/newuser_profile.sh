#!/bin/sh
# Where the new user's round trip spends its time (issue 46), in one guest: for the C program
# and the Rust one at both levels (send latency mode), callgrind at two iteration counts (the
# difference divided by the extra round trips is the cost per round trip without the setup),
# then strace -c (system calls), then perf stat and perf record -e cpu-clock (if perf runs).
#
#   sh examples/perf/newuser_profile.sh [EXAMPLES_DIR]
#
# Then the cost of one empty poll at each level: callgrind's totals with EMPTY_POLLS=0 and
# EMPTY_POLLS=$EMPTY (20000) polls of an empty CQ before the loop, over $EMPTY (`CGEMPTY` lines).
# Environment: N1 (1000), N2 (3000) round trips under callgrind; PERF_ITERS (20000); PARTS
# (default "callgrind strace perf empty"): which parts run.
# Everything goes to stdout (the guest's writes do not reach the host): each callgrind profile
# as a `CGFILE KIND N` line of gzip + base64, for callgrind_annotate on the host.
set -u
ex=${1:-${TARGET_DIR:-target}/release/examples}
n1=${N1:-1000}
n2=${N2:-3000}
perf_iters=${PERF_ITERS:-20000}
parts=${PARTS:-callgrind strace perf empty}
empty=${EMPTY:-20000}
has() { case " $parts " in *" $1 "*) return 0 ;; esac; return 1; }
here=$(dirname "$0")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
c="$tmp/newuser_c"
cc -O2 -g -o "$c" "$here/newuser.c" -libverbs || exit 1

cmd() {
    case $1 in
        c) echo "$c" ;;
        safe) echo "$ex/newuser" ;;
        unsafe) echo "$ex/newuser --unsafe" ;;
    esac
}

has callgrind && for kind in c safe unsafe; do
    for n in "$n1" "$n2"; do
        out="$tmp/cg.$kind.$n"
        # shellcheck disable=SC2046
        valgrind -q --tool=callgrind --callgrind-out-file="$out" $(cmd $kind) lat "$n" || echo "CG $kind $n failed"
        total=$(callgrind_annotate --threshold=99.99 "$out" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
        echo "CG $kind n=$n total=$total"
        # The whole profile, for callgrind_annotate on the host (the guest's files stay there).
        printf 'CGFILE %s %s ' "$kind" "$n"
        gzip -c "$out" | base64 -w 0
        echo
    done
done

has strace && for kind in c safe unsafe; do
    echo "STRACE $kind lat 2000"
    # shellcheck disable=SC2046
    strace -c -f -o "$tmp/st" $(cmd $kind) lat 2000 >/dev/null && sed -n '1,20p' "$tmp/st"
done

if ! has perf; then
    :
elif perf stat -e task-clock true >/dev/null 2>&1; then
    for kind in c safe unsafe; do
        echo "PERFSTAT $kind lat $perf_iters"
        # shellcheck disable=SC2046
        perf stat -e task-clock,context-switches,cpu-migrations,page-faults,minor-faults \
            $(cmd $kind) lat "$perf_iters" 2>&1 | grep -E 'RESULT|task-clock|context|migr|faults|elapsed|user|sys'
    done
    for kind in c safe unsafe; do
        echo "PERFREC $kind lat $perf_iters"
        # shellcheck disable=SC2046
        perf record -q -F 10000 -e cpu-clock -o "$tmp/perf.$kind" $(cmd $kind) lat "$perf_iters" >/dev/null 2>&1
        echo "PERFDSO $kind"
        perf report -i "$tmp/perf.$kind" --stdio --no-children --sort dso 2>/dev/null | grep -v '^#' | grep -v '^$' | head -n 12
        echo "PERFSYM $kind"
        perf report -i "$tmp/perf.$kind" --stdio --no-children --sort dso,sym 2>/dev/null | grep -v '^#' | grep -v '^$' |
            head -n 35
        echo "PERFUSER $kind"
        perf report -i "$tmp/perf.$kind" --stdio --no-children --sort dso,sym 2>/dev/null | grep -v '^#' | grep -v '^$' |
            grep -v kernel.kallsyms | head -n 25
    done
else
    echo "PERF: perf stat does not run in this guest"
fi

# cg_total KIND K: callgrind's total for KIND's latency mode (100 round trips) after K empty polls.
cg_total() {
    out="$tmp/cge.$1.$2"
    # shellcheck disable=SC2046
    EMPTY_POLLS=$2 valgrind -q --tool=callgrind --callgrind-out-file="$out" $(cmd "$1") lat 100 >/dev/null ||
        echo "CGEMPTY $1 $2 failed" >&2
    callgrind_annotate --threshold=99.99 "$out" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }'
}

has empty && for kind in c safe unsafe; do
    t0=$(cg_total "$kind" 0)
    tn=$(cg_total "$kind" "$empty")
    awk -v k="$kind" -v a="$t0" -v b="$tn" -v n="$empty" \
        'BEGIN { printf "CGEMPTY %s polls=%d total0=%s totalN=%s per_empty_poll=%.1f\n", k, n, a, b, (b - a) / n }'
done
