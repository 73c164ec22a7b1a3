# Shared by sweep.sh, compare.sh and profile.sh (sourced, not run): one server + client run
# of a perftest-style tool on this machine, and the CPU placement every tool gets.
#
# The sourcing script sets `work` (a directory for the outputs) and `run_timeout` (seconds one
# client or server may run) before calling these.

# pin_setup PIN: sets `srv_pin` and `cli_pin` to "taskset -c 1" and "taskset -c 0" when PIN is 1
# and the machine has two CPUs (and taskset), else to nothing. Both sides of the tests spin, and
# on a 2-CPU machine where the scheduler puts them moves a small message's latency by a third
# from run to run; every tool gets the same placement.
pin_setup() {
    srv_pin= cli_pin=
    if [ "$1" = 1 ] && [ "$(grep -c '^processor' /proc/cpuinfo)" -ge 2 ] && command -v taskset >/dev/null; then
        srv_pin="taskset -c 1" cli_pin="taskset -c 0"
    fi
}

# pair_run KIND TRIES SERVER_PREFIX CLIENT_PREFIX BIN ARGS...: runs `SERVER_PREFIX BIN ARGS` in
# the background and `CLIENT_PREFIX BIN ARGS 127.0.0.1`, each under `timeout $run_timeout`; the
# prefixes are lists of words (or empty). Ours retry connecting by themselves; perftest's client
# (KIND perftest) needs the server listening, so it is run again, up to TRIES times, while it
# reports that it could not connect. Outputs go to $work/server and $work/client; sets `rc` (the
# client's exit code) and `src` (the server's; the server is killed when the client failed).
pair_run() {
    pr_kind=$1 pr_tries=$2 pr_spre=$3 pr_cpre=$4
    shift 4
    # shellcheck disable=SC2086 # the prefixes are lists of words
    timeout "$run_timeout" $pr_spre "$@" >"$work/server" 2>&1 &
    pr_spid=$!
    pr_n=0
    while :; do
        # shellcheck disable=SC2086
        timeout "$run_timeout" $pr_cpre "$@" 127.0.0.1 >"$work/client" 2>&1
        rc=$?
        if [ $rc -ne 0 ] && [ "$pr_kind" = perftest ] && [ $pr_n -lt "$pr_tries" ] \
            && grep -q "Couldn't connect\|Unable to init the socket" "$work/client"; then
            pr_n=$((pr_n + 1))
            sleep 0.5
            continue
        fi
        break
    done
    [ $rc -eq 0 ] || kill "$pr_spid" 2>/dev/null
    wait "$pr_spid"
    src=$?
}
