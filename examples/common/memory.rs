//! Checks before large allocations: a buffer larger than the memory the kernel says is available
//! would be filled (touched) and pinned by registration, and the kernel's OOM killer would end
//! the process without a word. Refusing it up front gives a message instead.
#![allow(dead_code)] // each example uses a part of this module

/// The kernel's estimate of the memory available to new allocations (`MemAvailable` in
/// `/proc/meminfo`), in bytes; `None` where it does not say.
pub fn available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then(|| kib.saturating_mul(1024))
}

/// Memory left over for everything else: the process, the kernel's bookkeeping of pinned pages,
/// and the page cache that holds the running programs (with less, the kernel thrashes before its
/// OOM killer strikes, and the process crawls for minutes instead of failing).
const SLACK: u64 = 128 << 20;

/// Fails with a message when `len` bytes for `what` are more than the memory available.
pub fn check(len: u64, what: &str) -> Result<(), String> {
    match available() {
        Some(avail) if len.saturating_add(SLACK) > avail => Err(format!(
            "Couldn't allocate {what} of {len} bytes: only {avail} bytes of memory are available"
        )),
        _ => Ok(()),
    }
}

/// A vector of `n` zeros for `what`, or a message when the memory is not there (instead of the
/// allocator's abort).
pub fn zeroed_vec<T: Copy + Default>(n: u64, what: &str) -> Result<Vec<T>, String> {
    let bytes = n.saturating_mul(std::mem::size_of::<T>() as u64);
    check(bytes, what)?;
    let n = usize::try_from(n).map_err(|_| format!("Couldn't allocate {what} of {bytes} bytes"))?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| format!("Couldn't allocate {what} of {bytes} bytes: {e}"))?;
    v.resize(n, T::default());
    Ok(v)
}
