# Runs the steps of one `cargo xtask` job: `sh run.sh DIR`, with DIR the job folder.
#
# Run by the VM's init (chrooted into the host's root, DIR = /run/ibverbs-xtask) or directly on a host
# that has an RDMA device of its own. For N = 0, 1, ... while DIR/steps/N.sh exists, it runs
# `sh DIR/steps/N.sh` with DIR/env sourced, stdin from /dev/null, stdout to DIR/N.out and stderr to
# DIR/N.err, killed (with its whole process group) after DIR/steps/N.timeout seconds, and then writes
# the exit status to DIR/N.rc (124 after a timeout): the host streams N.out/N.err while N.rc is absent.
dir=$1
i=0
while [ -f "$dir/steps/$i.sh" ]; do
	limit=$(cat "$dir/steps/$i.timeout")
	start=$(date +%s)
	(
		. "$dir/env"
		exec timeout -k 5 "$limit" /bin/sh "$dir/steps/$i.sh"
	) </dev/null >"$dir/$i.out" 2>"$dir/$i.err"
	rc=$?
	if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
		# timeout(1) answers 124 after TERM and 137 when it had to KILL: tell both by the clock.
		[ $(($(date +%s) - start)) -ge "$limit" ] && rc=124
	fi
	echo "$rc" >"$dir/$i.rc.tmp"
	mv "$dir/$i.rc.tmp" "$dir/$i.rc"
	i=$((i + 1))
done
