//! Memory a region owns: [`OwnedBuffer`].

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Memory a [`MemoryRegion`](crate::MemoryRegion) owns: the crate's page-aligned allocation, a `Vec<u8>`, a
/// `Box<[u8]>`, or foreign memory (mmap, hugepages...) through [`OwnedBuffer::from_raw_parts`].
pub struct OwnedBuffer {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) len: usize,
    kind: BufferKind,
}

enum BufferKind {
    Aligned(Layout),
    Vec(usize),
    Raw(Option<Box<dyn FnOnce(*mut u8, usize) + Send + Sync>>),
}

// SAFETY: the buffer is uniquely owned heap memory (or foreign memory whose owner promised, in
// from_raw_parts, that it may be used and freed from any thread).
unsafe impl Send for OwnedBuffer {}
// SAFETY: shared access only reads through &self methods of the region that owns it.
unsafe impl Sync for OwnedBuffer {}

impl OwnedBuffer {
    /// `len` zeroed bytes, aligned to the page size (what the device likes best).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a length of 0 or one too large to allocate;
    /// [`Error::Verb`] naming `alloc_zeroed` (`ENOMEM`) when the host allocation fails.
    pub fn zeroed(len: usize) -> Result<OwnedBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument { verb: "ibv_reg_mr", reason: "zero-length memory region" });
        }
        let too_large =
            Error::InvalidArgument { verb: "ibv_reg_mr", reason: "length too large for an allocation" };
        let page = page_size();
        let size = len.checked_next_multiple_of(page).ok_or(too_large)?;
        let layout = Layout::from_size_align(size, page).map_err(|_| Error::InvalidArgument {
            verb: "ibv_reg_mr",
            reason: "length too large for an allocation",
        })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        // A host allocation failure, not a registration one (whose ENOMEM means the locked-memory
        // limit): named apart so that diagnostics do not confuse the two.
        let ptr = NonNull::new(ptr).ok_or(Error::Verb {
            verb: "alloc_zeroed",
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        })?;
        Ok(OwnedBuffer { ptr, len, kind: BufferKind::Aligned(layout) })
    }

    /// Takes foreign memory: `len` bytes at `ptr`, released by `free(ptr, len)` (if given) after
    /// the region is deregistered.
    ///
    /// `free` may panic: the crate stays sound (the memory is then leaked) and the panic
    /// propagates out of whatever dropped the buffer (a region's drop, or a
    /// [`CompletionQueue::poll`](crate::CompletionQueue::poll) releasing it).
    ///
    /// # Safety
    /// - `ptr` is valid for reads and writes of `len` bytes, and `len` is at most `isize::MAX`;
    /// - those bytes are initialised (the region derefs to `[u8]`: memory fresh from `malloc` or
    ///   `mmap` of an anonymous mapping is, from `malloc` only after it was written, e.g. zeroed);
    /// - they are used by nothing else from now until `free` is called (or forever, without
    ///   `free`): no other `OwnedBuffer`, Rust reference or registration of this crate covers
    ///   any of them;
    /// - `free` may run on any thread.
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        free: Option<Box<dyn FnOnce(*mut u8, usize) + Send + Sync>>,
    ) -> OwnedBuffer {
        OwnedBuffer { ptr, len, kind: BufferKind::Raw(free) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl From<Vec<u8>> for OwnedBuffer {
    fn from(v: Vec<u8>) -> Self {
        let mut v = std::mem::ManuallyDrop::new(v);
        let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
        // SAFETY: a Vec's pointer is never null (dangling but non-null when empty).
        OwnedBuffer { ptr: unsafe { NonNull::new_unchecked(ptr) }, len, kind: BufferKind::Vec(cap) }
    }
}

impl From<Box<[u8]>> for OwnedBuffer {
    fn from(b: Box<[u8]>) -> Self {
        OwnedBuffer::from(Vec::from(b))
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        match &mut self.kind {
            // SAFETY: allocated in `zeroed` with this layout.
            BufferKind::Aligned(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) },
            // SAFETY: rebuilt from the parts taken in `From<Vec<u8>>`.
            BufferKind::Vec(cap) => drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, *cap) }),
            BufferKind::Raw(free) => {
                if let Some(free) = free.take() {
                    free(self.ptr.as_ptr(), self.len);
                }
            }
        }
    }
}

impl fmt::Debug for OwnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedBuffer").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

/// The system's page size (what [`OwnedBuffer::zeroed`] aligns to).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_buffers() {
        assert!(OwnedBuffer::zeroed(0).is_err());
        // Regression (soundness hole 7): rounding up to a page overflowed, giving an `Ok` buffer
        // of usize::MAX bytes over a zero-size allocation in release builds.
        for len in [usize::MAX, usize::MAX - 1, isize::MAX as usize, (isize::MAX as usize) + 2] {
            assert!(matches!(OwnedBuffer::zeroed(len), Err(Error::InvalidArgument { .. })), "{len}");
        }
        let b = OwnedBuffer::zeroed(10).unwrap();
        assert_eq!(b.len(), 10);
        assert_eq!(b.ptr.as_ptr() as usize % page_size(), 0);
        let v = OwnedBuffer::from(vec![1u8, 2, 3]);
        assert_eq!(v.len(), 3);
        let b = OwnedBuffer::from(vec![9u8; 5].into_boxed_slice());
        assert_eq!(b.len(), 5);
        let freed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f2 = freed.clone();
        let mut mem = vec![0u8; 4];
        // SAFETY: mem (initialised) outlives the buffer and nothing else uses it meanwhile; the
        // closure only records the call.
        let raw = unsafe {
            OwnedBuffer::from_raw_parts(
                NonNull::new(mem.as_mut_ptr()).unwrap(),
                4,
                Some(Box::new(move |_, n| {
                    assert_eq!(n, 4);
                    f2.store(true, std::sync::atomic::Ordering::SeqCst)
                })),
            )
        };
        drop(raw);
        assert!(freed.load(std::sync::atomic::Ordering::SeqCst));
    }
}
