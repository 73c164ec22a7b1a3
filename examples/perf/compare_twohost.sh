#!/bin/sh
# Cross-host comparison of our perf examples with perftest's ib_* tools: `cargo xtask bench --twohost`
# runs it in both guests of a pair and prints the table; by hand:
#   cargo build --release --examples
#   cargo xtask rxe2 --timeout 1400 -- sh examples/perf/compare_twohost.sh ::: sh examples/perf/compare_twohost.sh
# PAIRS (8) pairs per test; TARGET_DIR (target) the cargo target folder.
# Guest A runs the servers, guest B the clients (ours and perftest's alternating, PAIRS pairs per
# test); B prints one RESULT line per run: test, tool, pair, exit status, the client's figure.
E=${TARGET_DIR:-target}/release/examples
role=$RXE2_ROLE
port=19000
for t in write_bw read_bw send_bw write_lat send_lat; do
  case $t in *_bw) s=65536 n=2000 ;; *) s=2 n=3000 ;; esac
  for pair in $(seq 1 "${PAIRS:-8}"); do
    for kind in ours perftest; do
      port=$((port + 1))
      if [ $kind = ours ]; then bin=$E/$t; else bin=ib_$t; fi
      if [ "$role" = a ]; then
        rxe2-barrier "s$port" 60 >/dev/null
        timeout 120 $bin -d rxe0 -x 1 -s $s -n $n -p $port >/tmp/srv.out 2>&1; rc=$?
        [ $rc -eq 0 ] || { echo "SERVER $t $kind pair$pair rc=$rc"; tail -8 /tmp/srv.out; }
        rxe2-barrier "e$port" 120 >/dev/null
      else
        rxe2-barrier "s$port" 60 >/dev/null
        tries=0
        while :; do
          timeout 120 $bin -d rxe0 -x 1 -s $s -n $n -p $port "$RXE2_PEER" >/tmp/cli.out 2>&1; rc=$?
          if [ $rc -ne 0 ] && [ $tries -lt 40 ] && grep -q "Couldn't connect\|Unable to init\|onnection refused" /tmp/cli.out; then tries=$((tries+1)); sleep 0.5; continue; fi
          break
        done
        case $t in *_bw) m=$(awk '/#bytes/ { if (getline > 0) { print $4; exit } }' /tmp/cli.out) ;; *) m=$(awk '/#bytes/ { if (getline > 0) { print $5; exit } }' /tmp/cli.out) ;; esac
        echo "RESULT $t $kind pair$pair rc=$rc ${m:-FAILED}"
        [ $rc -eq 0 ] || tail -8 /tmp/cli.out
        rxe2-barrier "e$port" 120 >/dev/null
      fi
    done
  done
done
