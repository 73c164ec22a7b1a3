# The two-host multicast step (xtask/src/twohost.rs, `mcast_step`): RDMA-CM multicast across the
# guests, our examples/mcast against rdmacm-utils' mckey. In each phase one guest sends 20
# datagrams of 100 bytes to a group of its own and the other guest's two receivers, ours and
# mckey, both joined first, must get them all: ours checks every datagram (length, GRH: IPv4/UDP to
# the group from the sender's address, immediate data = the sender's QP number) and every
# payload byte (our sender's pattern; mckey's one buffer: the same bytes in each datagram).
# Two phases, each way at once (a group per direction): 1. ours sends, A -> B and B -> A;
# 2. mckey sends, A -> B and B -> A. Every wait is bounded.
# Run with PRELUDE's helpers, E (the examples folder) and rxe2's RXE2_ROLE/RXE2_SELF/RXE2_PEER.

N=20
S=100

# phase N SEND_GROUP RECV_GROUP ours|mckey: our receiver and mckey's join RECV_GROUP, to which
# the other guest sends; once both guests' receivers have joined, the sender (ours or mckey)
# sends to SEND_GROUP, where the other guest's receivers wait.
phase() {
  timeout 25 stdbuf -oL "$E/mcast" -m "$3" -b "$RXE2_SELF" -C $N -S $S --peer "$4" --from "$RXE2_PEER" \
    --timeout 20 >/tmp/mr$1.out 2>&1 &
  po=$!
  timeout 25 stdbuf -oL mckey -m "$3" -b "$RXE2_SELF" -C $N -S $S >/tmp/mk$1.out 2>&1 &
  pm=$!
  i=0
  until grep -q 'mcast: joined' /tmp/mr$1.out && grep -q 'mckey: joined' /tmp/mk$1.out; do
    if [ $i -ge 150 ]; then
      cat /tmp/mr$1.out /tmp/mk$1.out
      die "phase $1: the receivers did not join $3 within 15 s"
    fi
    i=$((i + 1))
    sleep 0.1
  done
  rxe2-barrier ready$1 30 || die "phase $1: the other guest's receivers did not get ready"
  if [ "$4" = ours ]; then
    timeout 25 "$E/mcast" -m "$2" -b "$RXE2_SELF" -s -C $N -S $S --delay 1 --timeout 20 >/tmp/ms$1.out 2>&1
    rc=$?
    says="mcast: sent $N datagrams of $S bytes to $2"
  else
    timeout 25 mckey -m "$2" -b "$RXE2_SELF" -s -C $N -S $S >/tmp/ms$1.out 2>&1
    rc=$?
    says='data transfers complete'
  fi
  wait $po; ro=$?
  wait $pm; rm=$?
  echo "-- phase $1: the $4 sender to $2:"
  cat /tmp/ms$1.out
  echo "-- phase $1: our receiver and mckey's on $3:"
  cat /tmp/mr$1.out /tmp/mk$1.out
  [ $rc -eq 0 ] || die "phase $1: the $4 sender's exit $rc"
  must_say /tmp/ms$1.out "$says" "phase $1: the $4 sender"
  [ $ro -eq 0 ] || die "phase $1: our receiver's exit $ro"
  [ $rm -eq 0 ] || die "phase $1: mckey's receiver's exit $rm"
  must_say /tmp/mr$1.out "received $N datagrams of $S bytes from $3 (sender $RXE2_PEER" "phase $1: our receiver"
  if [ "$4" = mckey ]; then
    must_say /tmp/mr$1.out "mckey's payload: the same $S bytes in every datagram" "phase $1: our receiver"
  fi
  must_say /tmp/mk$1.out 'data transfers complete' "phase $1: mckey's receiver"
  must_say /tmp/mk$1.out 'return status 0' "phase $1: mckey's receiver"
  echo "twohost: mcast phase $1: $4 sender here -> $2; the other guest's $4 sender -> ours and mckey here on $3: ok"
  rxe2-barrier done$1 30 || die "phase $1: the other guest failed"
}

t0=$(ms)
if [ "$RXE2_ROLE" = a ]; then
  phase 1 239.255.43.11 239.255.43.13 ours
  phase 2 239.255.43.12 239.255.43.14 mckey
else
  phase 1 239.255.43.13 239.255.43.11 ours
  phase 2 239.255.43.14 239.255.43.12 mckey
fi
echo "twohost: mcast, 2 phases: $(($(ms) - t0)) ms"
