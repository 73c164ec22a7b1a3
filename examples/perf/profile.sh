#!/bin/sh
# Where a perftest-style test's user-space work goes, ours (safe and raw levels) against
# perftest's C tool: runs one side of each tool's pair under callgrind, once for ITERS
# iterations and once for twice as many, and prints the difference over ITERS, that is the
# instructions one more iteration (a latency test's round trip, a bandwidth test's message)
# costs (start-up and teardown cancel out), split by the object that ran them. The other side
# runs natively; both are pinned as in sweep.sh (server CPU 1, client CPU 0) when there are two
# CPUs.
#
# Usage: profile.sh EXAMPLES_DIR
#   EXAMPLES_DIR  where the tests are (release build).
# Environment (all optional):
#   IBVERBS_TEST_DEVICE (rxe0), IBVERBS_TEST_GID_INDEX (1)  device and GID index (-d, -x)
#   TESTS ("send_lat write_lat"; also write_bw, read_bw, send_bw), SIZE (2), ITERS (5000),
#   RUN_TIMEOUT (300)
#   SIDE  the side profiled: server or client. By default a latency test's server (it answers
#         each round trip, as the client does) and a bandwidth test's client (the sender, and
#         for write_bw and read_bw the only side that posts or polls).
#
# Output: one line per tool and test, instructions per iteration of the side profiled:
#   PROFILE TEST KIND SIDE tool=N provider=N libibverbs=N libc=N other=N total=N sort=N loop=N
# sort: the share of the report's sort of the latency samples (included in the objects' and
# the total's figures; 0 for bandwidth tests, which sort nothing); loop: total - sort, the
# iteration itself.
# tool: the program itself (ours: the example with this crate linked in; perftest: its binary);
# provider: librxe (post, poll, and the doorbell's system call wrapper it calls into libc is
# under libc). The figures include the polls that find the queue empty while the side waits:
# under callgrind it is the slow side, so it seldom waits, but they are not zero.
# Run it where a device and valgrind exist, e.g.
#   cargo xtask rxe --timeout 900 -- sh examples/perf/profile.sh target/release/examples
set -u

dir=${1:?usage: profile.sh EXAMPLES_DIR}
dev=${IBVERBS_TEST_DEVICE:-rxe0}
gid=${IBVERBS_TEST_GID_INDEX:-1}
tests=${TESTS:-send_lat write_lat}
size=${SIZE:-2}
iters=${ITERS:-5000}
run_timeout=${RUN_TIMEOUT:-300}
side=${SIDE:-}
case $side in
"" | server | client) ;;
*) echo "profile.sh: SIDE is server or client, not $side" >&2; exit 2 ;;
esac

command -v valgrind >/dev/null || { echo "profile.sh: valgrind not found" >&2; exit 2; }
for t in $tests; do
    [ -x "$dir/$t" ] || { echo "profile.sh: $dir/$t not found (cargo build --release --examples)" >&2; exit 2; }
    command -v "ib_$t" >/dev/null || { echo "profile.sh: ib_$t (perftest) not found" >&2; exit 2; }
done

# Callgrind names the program by the path it was started with: an absolute one.
abs=$(cd "$dir" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
port=21000
failed=0
# shellcheck source=examples/perf/pair.sh
. "$(dirname "$0")/pair.sh"
pin_setup 1

# by_object FILE: "OBJECT INSTRUCTIONS" lines, the self cost of every object in a callgrind
# output file (the cost line after a `calls=` line is a call's inclusive cost: skipped), and a
# "SORT INSTRUCTIONS" line: the inclusive cost of the calls into a sort (a function whose name
# has "sort" in it, called from one whose name has not), which is each tool's sort of its
# latency samples for the report (perftest's `qsort`, ours `sort_unstable`): it grows as
# N log N, so it does not cancel out between the two runs.
by_object() {
    awk '
        # An object or a function is named once, "(ID) NAME", then "(ID)" alone.
        function named(s, table,    id, rest) {
            if (!match(s, /^\([0-9]+\)/)) return s
            id = substr(s, 1, RLENGTH)
            rest = substr(s, RLENGTH + 2)
            if (rest != "") table[id] = rest
            return table[id]
        }
        /^ob=/ { ob = named(substr($0, 4), obs); next }
        /^cob=/ { named(substr($0, 5), obs); next }
        /^fn=/ { fn = named(substr($0, 4), fns); next }
        /^cfn=/ { cfn = named(substr($0, 5), fns); next }
        /^calls=/ { skip = 1; next }
        /^[0-9+*-]/ {
            n = split($0, f, " ")
            if (skip) {
                skip = 0
                if (n >= 2 && cfn ~ /sort/ && fn !~ /sort/) sorting += f[n]
                next
            }
            if (n >= 2) cost[ob] += f[n]
            next
        }
        END { for (o in cost) print o, cost[o]; print "SORT", sorting + 0 }
    ' "$1"
}

# side_of TEST: the side profiled (SIDE, or the test's default).
side_of() {
    if [ -n "$side" ]; then
        echo "$side"
    else
        case $1 in
        *_bw) echo client ;;
        *) echo server ;;
        esac
    fi
}

# profile KIND TEST N: runs the pair once with N iterations, one side under callgrind; leaves
# that side's per-object costs in $work/KIND.N.
profile() {
    kind=$1 t=$2 n=$3
    port=$((port + 1))
    cg="valgrind -q --tool=callgrind --dump-instr=no --callgrind-out-file=$work/cg.%p"
    if [ "$(side_of "$t")" = server ]; then
        spre="$srv_pin $cg" cpre="$cli_pin"
    else
        spre="$srv_pin" cpre="$cli_pin $cg"
    fi
    case $kind in
    safe) bin="$abs/$t" extra=--safe ;;
    raw) bin="$abs/$t" extra=--raw ;;
    *) bin=$(command -v "ib_$t") extra= ;;
    esac
    # No peak bandwidth (-N, every tool): its search over windows of messages grows with the
    # square of the iterations, so it would not cancel out.
    case $t in
    *_bw) extra="$extra -N" ;;
    esac
    rm -f "$work"/cg.*
    # The server under valgrind takes seconds to listen: perftest's client is run again for up
    # to a minute.
    # shellcheck disable=SC2086 # $extra is one flag or none
    pair_run "$kind" 120 "$spre" "$cpre" "$bin" -d "$dev" -x "$gid" -p "$port" -s "$size" -n "$n" $extra
    # perftest measures the CPU's frequency for its report, and under callgrind the measurement
    # often fails ("Can't produce a report", exit 1) after the iterations ran in full: the
    # profile is whole, only the report is missing (and the other side, waiting for the end of
    # the test that never comes, fails or is stopped).
    if [ "$kind" = perftest ]; then
        if [ "$(side_of "$t")" = server ]; then prof=$work/server; else prof=$work/client; fi
        if grep -q "Can't produce a report" "$prof"; then
            rc=0 src=0
        fi
    fi
    if [ $rc -ne 0 ] || [ $src -ne 0 ]; then
        echo "profile.sh: $kind $t -n $n failed (client $rc, server $src)" >&2
        tail -3 "$work/client" "$work/server" >&2
        failed=1
        : >"$work/$kind.$n"
        return
    fi
    for f in "$work"/cg.*; do by_object "$f"; done | awk -v bin="$bin" '
        {
            o = $1
            g = "other"
            if (o == "SORT") g = "sort"
            else if (o == bin) g = "tool"
            else if (o ~ /librxe/) g = "provider"
            else if (o ~ /libibverbs\.so/) g = "libibverbs"
            else if (o ~ /\/libc\.so/) g = "libc"
            s[g] += $2
        }
        END { for (g in s) print g, s[g] }
    ' >"$work/$kind.$n"
}

for t in $tests; do
    for kind in safe raw perftest; do
        profile "$kind" "$t" "$iters"
        profile "$kind" "$t" $((iters * 2))
        awk -v t="$t" -v k="$kind" -v side="$(side_of "$t")" -v n="$iters" '
            FNR == NR { a[$1] = $2; next }
            { b[$1] = $2 }
            END {
                line = "PROFILE " t " " k " " side
                total = 0
                split("tool provider libibverbs libc other", gs, " ")
                for (i = 1; i <= 5; i++) {
                    v = (b[gs[i]] - a[gs[i]]) / n
                    if (v > -0.5 && v < 0.5) v = 0 # no "-0"
                    total += v
                    line = line sprintf(" %s=%.0f", gs[i], v)
                }
                v = (b["sort"] - a["sort"]) / n
                print line sprintf(" total=%.0f sort=%.0f loop=%.0f", total, v, total - v)
            }
        ' "$work/$kind.$iters" "$work/$kind.$((iters * 2))"
    done
done
exit $failed
