#!/bin/sh
# The new user's program (issue 46) in C and in Rust, alternating in one guest: each round runs
# the C program (examples/perf/newuser.c), the Rust one at the safe level and at the `unsafe`
# level (examples/newuser.rs), in an order rotated every round, first the send latency, then
# the write bandwidth; then prints the per-round ratios to C and their medians.
#
#   sh examples/perf/newuser.sh [EXAMPLES_DIR]
#
# EXAMPLES_DIR holds the release build of `newuser` (default: $TARGET_DIR/release/examples, else
# target/release/examples). The C program is $NEWUSER_C if set, else compiled here with cc -O2.
# Environment: ROUNDS (10), LAT_ITERS (10000), BW_ITERS (2000), SIZE (65536), WINDOW (16),
# IBVERBS_TEST_DEVICE, IBVERBS_TEST_GID_INDEX; MODES ("lat bw"); CSPIN (see below).
# Output: the RESULT lines of every run; per round and mode two `ROUND` lines with the ratios to
# C, of the runs' medians ("med": the median round trip's half, the median 50-write chunk's
# rate; robust to other load on the machine) and of their means ("mean": the total time over
# the iterations); then `MEDIAN` lines: the median of each ratio over the rounds, its range,
# and how many rounds were above 1 (for latency: slower than C; for bandwidth: faster); then
# `QUARTILE` lines: the ratio of each program's quartile of its runs' medians to C's (below).
set -u
ex=${1:-${TARGET_DIR:-target}/release/examples}
rounds=${ROUNDS:-10}
lat_iters=${LAT_ITERS:-10000}
bw_iters=${BW_ITERS:-2000}
modes=${MODES:-lat bw}
rust="$ex/newuser"
[ -x "$rust" ] || { echo "newuser.sh: no $rust (cargo build --release --example newuser)" >&2; exit 1; }
here=$(dirname "$0")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
c=${NEWUSER_C:-}
if [ -z "$c" ]; then
    c="$tmp/newuser_c"
    cc -O2 -o "$c" "$here/newuser.c" -libverbs || { echo "newuser.sh: cc failed" >&2; exit 1; }
fi
echo "newuser.sh: $rounds rounds, lat $lat_iters round trips, bw $bw_iters writes of ${SIZE:-65536} B, window ${WINDOW:-16}; device ${IBVERBS_TEST_DEVICE:-?} gid ${IBVERBS_TEST_GID_INDEX:-?}"

# run KIND MODE ITERS: one run; prints its RESULT line and appends its figures to
# $tmp/MODE.KIND (the median one: med_us / med_mb_s) and $tmp/MODE.KIND.mean (lat_us / mb_s).
run() {
    case $1 in
        c) line=$("$c" "$2" "$3") ;;
        safe) line=$("$rust" "$2" "$3") ;;
        unsafe) line=$("$rust" --unsafe "$2" "$3") ;;
        cspin) line=$(SPIN=$CSPIN "$c" "$2" "$3") ;;
        ctouch) line=$(TOUCH=$CTOUCH "$c" "$2" "$3") ;;
        cmemcpy) line=$(MEMCPY=$CMEMCPY "$c" "$2" "$3") ;;
    esac || { echo "newuser.sh: $1 $2 failed" >&2; return 1; }
    echo "$line"
    if [ "$2" = lat ]; then med=med_us mean=lat_us; else med=med_mb_s mean=mb_s; fi
    echo "$line" | tr ' ' '\n' | sed -n "s/^$med=//p" >>"$tmp/$2.$1"
    echo "$line" | tr ' ' '\n' | sed -n "s/^$mean=//p" >>"$tmp/$2.$1.mean"
}

# CSPIN=K adds a fourth program, C with SPIN=K (examples/perf/newuser.c: 6K more user-space
# instructions per round trip; latency only), to measure what instructions cost in this guest.
# CTOUCH=K likewise adds C with TOUCH=K (one byte read from each of K more pages per round trip).
others="safe unsafe"
[ -n "${CSPIN:-}" ] && others="$others cspin"
[ -n "${CTOUCH:-}" ] && others="$others ctouch"
# CMEMCPY=K: C with MEMCPY=K (K calls of memcpy of 256 bytes per round trip).
[ -n "${CMEMCPY:-}" ] && others="$others cmemcpy"
status=0
r=1
while [ "$r" -le "$rounds" ]; do
    case $((r % 3)) in
        1) order="c safe unsafe" ;;
        2) order="safe unsafe c" ;;
        0) order="unsafe c safe" ;;
    esac
    [ -n "${CSPIN:-}" ] && order="$order cspin"
    [ -n "${CTOUCH:-}" ] && order="$order ctouch"
    [ -n "${CMEMCPY:-}" ] && order="$order cmemcpy"
    for mode in $modes; do
        iters=$([ "$mode" = lat ] && echo "$lat_iters" || echo "$bw_iters")
        for kind in $order; do
            case $kind in cspin | ctouch | cmemcpy) [ "$mode" != lat ] && continue ;; esac
            run "$kind" "$mode" "$iters" || status=1
        done
        for stat in med mean; do
            sfx=$([ "$stat" = mean ] && echo .mean)
            line="ROUND $r $mode $stat"
            ratios=""
            cv=$(sed -n "${r}p" "$tmp/$mode.c$sfx" 2>/dev/null)
            for kind in c $others; do
                case $kind in cspin | ctouch | cmemcpy) [ "$mode" != lat ] && continue ;; esac
                v=$(sed -n "${r}p" "$tmp/$mode.$kind$sfx" 2>/dev/null)
                [ -n "$v" ] && [ -n "$cv" ] || continue 2
                line="$line $kind=$v"
                [ "$kind" = c ] || ratios="$ratios $(awk -v k="$kind" -v v="$v" -v c="$cv" 'BEGIN { printf "%s/c=%.3f", k, v / c }')"
            done
            echo "$line$ratios" | tee -a "$tmp/rounds"
        done
    done
    r=$((r + 1))
done

# Medians of the per-round ratios, with their ranges and how many rounds were above C.
for mode in $modes; do
    for stat in med mean; do
        for lvl in $others; do
            grep "^ROUND [0-9]* $mode $stat " "$tmp/rounds" 2>/dev/null | tr ' ' '\n' | sed -n "s|^$lvl/c=||p" | sort -n |
                awk -v m="$mode" -v st="$stat" -v l="$lvl" '{ v[NR] = $1; if ($1 > 1) above++ }
                    END { if (NR == 0) exit; med = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
                          printf "MEDIAN %s %s %s/c=%.3f min=%.3f max=%.3f rounds=%d above=%d\n", m, st, l, med, v[1], v[NR], NR, above + 0 }'
        done
    done
done

# The same ratios from each program's quartile over the rounds: the lower quartile of its runs'
# medians for latency, the upper one for bandwidth (the host's slow phases only add time). On a
# host whose speed flips between runs (seen: 23 and 40 us round trips minutes apart), a round's
# three runs may fall in different phases and its ratio with them; the quartiles compare the
# programs in the same, fast phase.
for mode in $modes; do
    cq=""
    for kind in c $others; do
        case $kind in cspin | ctouch | cmemcpy) [ "$mode" != lat ] && continue ;; esac
        [ -s "$tmp/$mode.$kind" ] || continue
        q=$(sort -n "$tmp/$mode.$kind" | awk -v m="$mode" '{ v[NR] = $1 }
            END { k = int((NR + 3) / 4); if (m == "bw") k = NR + 1 - k; print v[k] }')
        if [ "$kind" = c ]; then
            cq=$q
            continue
        fi
        [ -n "$cq" ] && awk -v m="$mode" -v k="$kind" -v v="$q" -v c="$cq" 'BEGIN {
            printf "QUARTILE %s med %s/c=%.3f %s=%s c=%s\n", m, k, v / c, k, v, c }'
    done
done
exit $status
