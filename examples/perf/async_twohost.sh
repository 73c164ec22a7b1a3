#!/bin/sh
# The async adaptor's clients against one server across two guests (issue 46): guest B serves
# (`async_rpc --busy-poll`, started afresh for each client run), guest A runs the client as the
# synchronous safe level (`--sync`), the async adaptor busy polling, with the default adaptive
# wait, and on the event path, in turn, ROUNDS times; each client prints its requests per second,
# latency percentiles and its process's CPU time.
#
#   cargo build --release --example async_rpc --features tokio
#   cargo xtask rxe2 -- sh examples/perf/async_twohost.sh ::: sh examples/perf/async_twohost.sh
#
# Environment: ROUNDS (3), N (3000 requests per run), C (1 in flight), EXAMPLES (the release
# examples folder: $TARGET_DIR/release/examples, else target/release/examples). The side comes
# from RXE2_ROLE (a: clients, b: server); the sides meet at `rxe2-barrier` before each run.
set -u
ex=${EXAMPLES:-${TARGET_DIR:-target}/release/examples}
b="$ex/async_rpc"
[ -x "$b" ] || { echo "no $b (cargo build --release --example async_rpc --features tokio)"; exit 1; }
i=0
for r in $(seq 1 "${ROUNDS:-3}"); do
    for m in sync busy adaptive events; do
        i=$((i + 1))
        case $RXE2_ROLE in
        a)
            case $m in sync) f=--sync ;; busy) f=--busy-poll ;; adaptive) f= ;; events) f=--events ;; esac
            rxe2-barrier "s$i" 60 || exit 1
            # The server listens by now (it reached the barrier after starting).
            sleep 0.5
            # shellcheck disable=SC2086
            "$b" -d "${IBVERBS_TEST_DEVICE:-rxe0}" -g "${IBVERBS_TEST_GID_INDEX:-1}" -n "${N:-3000}" -c "${C:-1}" \
                $f "$RXE2_PEER" | sed "s/^/ROUND $r /" || exit 1
            ;;
        *)
            "$b" -d "${IBVERBS_TEST_DEVICE:-rxe0}" -g "${IBVERBS_TEST_GID_INDEX:-1}" --busy-poll >/dev/null 2>&1 &
            sleep 0.5
            rxe2-barrier "s$i" 60 || exit 1
            wait $! || exit 1
            ;;
        esac
    done
done
