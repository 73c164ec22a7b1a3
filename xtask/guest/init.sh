#!/bin/busybox sh
# PID 1 of the xtask SoftRoCE VM, run from the initramfs that `cargo xtask` builds (see xtask/src/image.rs).
#
# 1. loads the modules listed in /etc/modules.load (virtio, 9p, overlayfs, dummy, rdma_rxe, rdma_ucm);
# 2. mounts the host's / (9p share `hostroot`, read-only) under a tmpfs overlay at /newroot, so host-built
#    binaries run unchanged at their host paths and every write stays in the VM;
# 3. mounts the job folder (9p share `xtask`, read-write) at /newroot$JOB, reads $JOB/vm.conf (with
#    MODULES_DIR, a kernel not the host's: links it at /lib/modules/<version>);
# 4. creates dummy0 (192.0.2.1/24) and rxe0 over it (or, with DEVICE=siw0 in vm.conf, loads the siw
#    module xtask built, SIW_MODULE, after its dependencies SIW_DEPENDS, and creates siw0 over dummy0:
#    siw does not work over lo), waits for its port to be ACTIVE;
# 5. touches $JOB/ready and runs $JOB/run.sh chrooted into /newroot, which runs the job's steps;
# 6. reboots, which ends QEMU (-no-reboot).
# Anything that goes wrong before step 5 is written to $JOB/setup-failed for the host to report.
# This script's own output goes to the serial console (the host's console.log).

/bin/busybox mkdir -p /bin /proc /sys /dev /mnt/host /mnt/rw /newroot
/bin/busybox --install -s /bin
export PATH=/bin

R=/newroot
JOB=/run/ibverbs-xtask
S=$R$JOB

log() { echo "xtask-init: $*"; }

fail() {
	log "FAILED: $*"
	if [ -f "$S/vm.conf" ]; then echo "$*" >"$S/setup-failed"; fi
	sync
	reboot -f
	sleep 60
}

# Run a program of the host's root (iproute2, rdma) with a clean environment.
host() { chroot "$R" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

while read -r mod params; do
	[ -n "$mod" ] || continue
	# shellcheck disable=SC2086 # the module parameters are separate words
	insmod "/lib/modules/$mod" $params || fail "insmod $mod $params"
done </etc/modules.load

P9="trans=virtio,version=9p2000.L,msize=262144"
mount -t 9p -o "$P9,ro,cache=loose" hostroot /mnt/host || fail "mounting the host's root (9p hostroot)"
mount -t tmpfs -o mode=0755 tmpfs /mnt/rw || fail "mounting the overlay's tmpfs"
mkdir -p /mnt/rw/upper /mnt/rw/work
mount -t overlay -o lowerdir=/mnt/host,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work overlay "$R" ||
	fail "mounting the overlay on the host's root"
# Modules the kernel asks for later (request_module) come from the host's root, through its modprobe.
printf '#!/bin/busybox sh\nexec /bin/busybox chroot %s /sbin/modprobe "$@"\n' "$R" >/bin/modprobe-host
chmod 755 /bin/modprobe-host
echo /bin/modprobe-host >/proc/sys/kernel/modprobe
mount -t proc proc "$R/proc" || fail "mounting /proc"
mount -t sysfs sysfs "$R/sys" || fail "mounting /sys"
mount -t devtmpfs devtmpfs "$R/dev" || fail "mounting /dev"
mkdir -p "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts "$R/dev/pts" || fail "mounting /dev/pts"
mount -t tmpfs -o mode=1777 tmpfs "$R/dev/shm" || fail "mounting /dev/shm"
mkdir -p "$S"
mount -t 9p -o "$P9" xtask "$S" || fail "mounting the job folder (9p xtask)"
[ -f "$S/vm.conf" ] || fail "no vm.conf in the job folder"
. "$S/vm.conf"
# A kernel that is not the host's (cargo xtask --kernel): its modules, unpacked in xtask's cache (a host
# path, seen at the same path here), stand in for /lib/modules/<its version> for modprobe-host.
if [ -n "${MODULES_DIR:-}" ]; then
	mkdir -p "$R/lib/modules" && ln -sfn "$MODULES_DIR" "$R/lib/modules/$(uname -r)" ||
		fail "linking $MODULES_DIR at /lib/modules/$(uname -r)"
fi

host ip link set lo up || fail "ip link set lo up"
host ip link add dummy0 type dummy || fail "ip link add dummy0 type dummy"
host ip link set dummy0 mtu "${MTU:-1500}" || fail "ip link set dummy0 mtu ${MTU:-1500}"
host ip addr add 192.0.2.1/24 dev dummy0 || fail "ip addr add 192.0.2.1/24 dev dummy0"
host ip link set dummy0 up || fail "ip link set dummy0 up"
DEV=${DEVICE:-rxe0}
case "$DEV" in
rxe0) host rdma link add rxe0 type rxe netdev dummy0 || fail "rdma link add rxe0 type rxe netdev dummy0" ;;
siw0)
	for dep in $SIW_DEPENDS; do
		[ -d "/sys/module/$dep" ] || host modprobe "$dep" || fail "modprobe $dep (a dependency of siw)"
	done
	insmod "$R$SIW_MODULE" || fail "insmod $SIW_MODULE"
	host rdma link add siw0 type siw netdev dummy0 || fail "rdma link add siw0 type siw netdev dummy0"
	;;
*) fail "unknown DEVICE=$DEV in vm.conf" ;;
esac
n=0
until grep -q ACTIVE "/sys/class/infiniband/$DEV/ports/1/state" 2>/dev/null; do
	n=$((n + 1))
	[ "$n" -le 100 ] || fail "$DEV port 1 not ACTIVE after 10 s: $(cat "/sys/class/infiniband/$DEV/ports/1/state")"
	sleep 0.1
done

log "$DEV ACTIVE (netdev dummy0, MTU ${MTU:-1500}); running the job"
: >"$S/ready"
chroot "$R" /usr/bin/env -i /bin/sh "$JOB/run.sh" "$JOB"
log "job finished (run.sh exit $?)"
sync
reboot -f
sleep 60
