//! Running code as an unprivileged job would: a low `RLIMIT_MEMLOCK` and no `CAP_IPC_LOCK`
//! (shared by the host and device tests of the memlock diagnostics).

/// Sets this thread's effective capabilities (the first 32) to `effective` ∩ permitted;
/// returns the previous effective set.
pub fn set_effective_caps(effective: u32) -> u32 {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header { version: 0x2008_0522, pid: 0 }; // _LINUX_CAPABILITY_VERSION_3
    let mut data = [Data::default(); 2];
    // SAFETY: capget with a v3 header and room for the two data structs it writes.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    assert_eq!(rc, 0, "capget: {}", std::io::Error::last_os_error());
    let old = data[0].effective;
    data[0].effective = effective & data[0].permitted;
    // SAFETY: capset of this thread with what capget returned, effective ⊆ permitted.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) };
    assert_eq!(rc, 0, "capset: {}", std::io::Error::last_os_error());
    old
}

/// Runs `f` on this thread with the soft RLIMIT_MEMLOCK at `bytes` and without CAP_IPC_LOCK,
/// then restores both (also when `f` panics). The limit is the process's: run where no other
/// thread registers memory meanwhile.
pub fn with_memlock<T>(bytes: u64, f: impl FnOnce() -> T) -> T {
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old) }, 0);
    let low = libc::rlimit { rlim_cur: bytes, rlim_max: old.rlim_max };
    // SAFETY: valid rlimit; lowering the soft limit is always allowed.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &low) }, 0);
    let caps = set_effective_caps(0);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    set_effective_caps(caps);
    // SAFETY: restores the limit read above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &old) }, 0);
    result.unwrap_or_else(|p| std::panic::resume_unwind(p))
}
