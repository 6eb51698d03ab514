//! The engine binaries' global allocator: large blocks (≥ 64 KiB: a prefill chunk's activations, its
//! attention and expert buffers) kept for reuse once freed, all of them on transparent huge pages (those
//! below 2 MiB cut from a 2 MiB page, the rest of which waits in the pool for blocks of that size);
//! everything else from the system allocator.
//!
//! Why: glibc hands each large block back to the OS when it is freed (its mmap threshold), so the next op's
//! block of the same size faults its pages in again, 4 KiB at a time. The bench's process for a cold 3.5K-token
//! prefill of the bundled model faulted ~27K pages (Intel Xeon host, 2 threads: 10-20 % of its time); with
//! blocks from 256 KiB kept and reused, ~10K. A block's first touch still faults: there, 4 KiB pages cost
//! ~0.6 ms per MiB (~2.3 µs a fault), a 2 MiB huge page 0.18 ms per MiB; so blocks from 64 KiB are kept and
//! those below 2 MiB cut from huge pages too: ~3.4K. Binaries opt in with `#[global_allocator] static A:
//! nextn_engine::alloc::Retaining = nextn_engine::alloc::Retaining;`.
//!
//! Kept blocks are bounded ([`RETAIN_MAX`] bytes, beyond which a freed block goes back to the OS) and reused
//! only at their exact (rounded, see [`mapped_len`]) size. Where the kernel has no transparent huge pages (or they are
//! `never`), the advice is ignored and only the reuse remains.

use std::alloc::{GlobalAlloc, Layout, System};

/// Smallest block served from huge pages.
const LARGE: usize = 64 << 10;
/// Huge page size (x86-64, aarch64 with 4 KiB base pages): blocks from this size are mapped on huge pages.
const HUGE: usize = 2 << 20;
/// Most alignment a large block is served with (mappings are page-aligned; huge ones 2 MiB-aligned).
const PAGE: usize = 4096;
/// Most bytes kept in freed blocks.
pub const RETAIN_MAX: usize = 512 << 20;

/// The allocator (see the module doc).
pub struct Retaining;

/// Freed large blocks `(address, length, never used: still the zeros the OS mapped)` and their total length.
struct Pool {
    free: Vec<(usize, usize, bool)>,
    bytes: usize,
}

/// The pool's lock is a futex (no allocation); the free list's own growth allocates a small block
/// from [`System`] (a separate lock), so no call re-enters this one.
static POOL: std::sync::Mutex<Pool> = std::sync::Mutex::new(Pool { free: Vec::new(), bytes: 0 });

fn large(layout: Layout) -> bool {
    cfg!(target_os = "linux") && layout.size() >= LARGE && layout.align() <= PAGE
}

/// The length a large block gets: from 2 MiB whole huge pages; below, the next power of two (few sizes, so
/// freed blocks match later requests, and a huge page holds a whole number of them).
fn mapped_len(layout: Layout) -> usize {
    if layout.size() >= HUGE { layout.size().next_multiple_of(HUGE) } else { layout.size().next_power_of_two() }
}

/// A freed block of exactly `len` bytes, if one is kept, and whether it still holds the OS's zeros.
fn take(len: usize) -> Option<(*mut u8, bool)> {
    let mut pool = POOL.lock().ok()?;
    let i = pool.free.iter().position(|&(_, l, _)| l == len)?;
    let (addr, _, zero) = pool.free.swap_remove(i);
    pool.bytes -= len;
    Some((addr as *mut u8, zero))
}

/// A fresh block of `len` bytes (a [`mapped_len`]): from [`HUGE`] its own mapping; below, the first of the
/// `HUGE / len` blocks of a new huge page, the others kept in the pool as never used (while it has room;
/// else a mapping of its own). Null when the OS refuses.
fn fresh(len: usize) -> *mut u8 {
    if len >= HUGE {
        return os::map(len);
    }
    let mut pool = match POOL.lock() {
        Ok(pool) if pool.bytes + HUGE - len <= RETAIN_MAX => pool,
        _ => return os::map(len),
    };
    let page = os::map(HUGE);
    if page.is_null() {
        return page;
    }
    for at in (len..HUGE).step_by(len) {
        pool.free.push((page as usize + at, len, true));
    }
    pool.bytes += HUGE - len;
    page
}

#[cfg(target_os = "linux")]
mod os {
    use super::HUGE;

    /// `len` fresh zero bytes; from [`HUGE`] (then a multiple of it) aligned to it and advised onto huge
    /// pages; null when the OS refuses.
    pub fn map(len: usize) -> *mut u8 {
        if len < HUGE {
            // SAFETY: an anonymous private mapping (no file, no fixed address).
            let raw = unsafe {
                libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
            };
            return if raw == libc::MAP_FAILED { std::ptr::null_mut() } else { raw.cast() };
        }
        // SAFETY: an anonymous private mapping (no file, no fixed address); the unaligned head and tail of
        // the over-sized mapping are unmapped, leaving exactly [aligned, aligned + len).
        unsafe {
            let raw = libc::mmap(
                std::ptr::null_mut(),
                len + HUGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if raw == libc::MAP_FAILED {
                return std::ptr::null_mut();
            }
            let start = raw as usize;
            let aligned = start.next_multiple_of(HUGE);
            if aligned > start {
                libc::munmap(raw, aligned - start);
            }
            let tail = start + len + HUGE - (aligned + len);
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
            // Advice only: ignored where transparent huge pages are off.
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            aligned as *mut u8
        }
    }

    /// Returns a block from [`map`] to the OS.
    ///
    /// # Safety
    /// `p` and `len` are a block [`map`] returned, not used after.
    pub unsafe fn unmap(p: *mut u8, len: usize) {
        // SAFETY: per the contract.
        unsafe { libc::munmap(p.cast(), len) };
    }
}

#[cfg(not(target_os = "linux"))]
mod os {
    pub fn map(_len: usize) -> *mut u8 {
        unreachable!("large blocks are served here only on Linux")
    }
    pub unsafe fn unmap(_p: *mut u8, _len: usize) {
        unreachable!("large blocks are served here only on Linux")
    }
}

// SAFETY: small blocks are System's; large ones are `mapped_len` bytes (a whole mapping, or a disjoint piece of
// a huge page) aligned to at least a page (≥ any alignment served here), handed to one owner at a time (taken
// from the pool under its lock), and returned to the pool or the OS only by `dealloc` with the same layout.
unsafe impl GlobalAlloc for Retaining {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !large(layout) {
            // SAFETY: forwarded as given.
            return unsafe { System.alloc(layout) };
        }
        let len = mapped_len(layout);
        take(len).map_or_else(|| fresh(len), |(p, _)| p)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !large(layout) {
            // SAFETY: forwarded as given.
            return unsafe { System.alloc_zeroed(layout) };
        }
        let len = mapped_len(layout);
        match take(len) {
            // Never used: the OS's zeros.
            Some((p, true)) => p,
            Some((p, false)) => {
                // SAFETY: the block holds len ≥ layout.size() writable bytes.
                unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                p
            }
            // Fresh mappings read as zero.
            None => fresh(len),
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        if !large(layout) {
            // SAFETY: p came from System.alloc with this layout (large() is a function of the layout).
            return unsafe { System.dealloc(p, layout) };
        }
        let len = mapped_len(layout);
        if let Ok(mut pool) = POOL.lock()
            && pool.bytes + len <= RETAIN_MAX
        {
            pool.free.push((p as usize, len, false));
            pool.bytes += len;
            return;
        }
        // SAFETY: p is a whole mapping of len bytes from os::map, or len bytes of one (a piece of a huge page:
        // unmapping it splits the page), no longer used.
        unsafe { os::unmap(p, len) };
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract (layout fits p, new_size valid for its alignment).
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (large(layout), large(new)) {
            // SAFETY: both System's, forwarded as given.
            (false, false) => unsafe { System.realloc(p, layout, new_size) },
            // Still inside the mapping: nothing moves.
            (true, true) if mapped_len(layout) == mapped_len(new) => p,
            _ => {
                // SAFETY: a new block of the new layout, the old contents copied (the smaller of the two
                // sizes), the old block freed with its own layout.
                unsafe {
                    let q = self.alloc(new);
                    if !q.is_null() {
                        std::ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                        self.dealloc(p, layout);
                    }
                    q
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Large blocks come back zeroed when asked, keep their contents through a realloc within and across
    /// mappings, and are reused after a free; small ones are System's.
    #[test]
    fn large_blocks_are_reused_zeroed_and_reallocated() {
        let a = Retaining;
        unsafe {
            let l = Layout::from_size_align(3 << 20, 64).unwrap();
            let p = a.alloc_zeroed(l);
            assert!(!p.is_null() && (p as usize).is_multiple_of(HUGE));
            // Below 2 MiB: a power-of-two mapping, page-aligned, reused at that size.
            let small = Layout::from_size_align(300 << 10, 64).unwrap();
            let m = a.alloc(small);
            assert!(!m.is_null() && (m as usize).is_multiple_of(PAGE) && mapped_len(small) == 512 << 10);
            std::ptr::write_bytes(m, 3, small.size());
            a.dealloc(m, small);
            let m = a.alloc_zeroed(Layout::from_size_align(400 << 10, 64).unwrap());
            assert!((0..400 << 10).step_by(4093).all(|i| *m.add(i) == 0));
            a.dealloc(m, Layout::from_size_align(400 << 10, 64).unwrap());
            assert!((0..l.size()).step_by(4093).all(|i| *p.add(i) == 0));
            std::ptr::write_bytes(p, 7, l.size());
            a.dealloc(p, l);
            // Same rounded size: a kept block (this one or another test's), zeroed again.
            let q = a.alloc_zeroed(Layout::from_size_align((3 << 20) + 5, 64).unwrap());
            assert!((0..(3 << 20) + 5).step_by(4093).all(|i| *q.add(i) == 0));
            std::ptr::write_bytes(q, 9, 3 << 20);
            // Grow across mappings: contents kept.
            let lq = Layout::from_size_align((3 << 20) + 5, 64).unwrap();
            let r = a.realloc(q, lq, 9 << 20);
            assert!((0..3 << 20).step_by(4093).all(|i| *r.add(i) == 9));
            // Shrink below LARGE: contents kept, now a System block.
            let s = a.realloc(r, Layout::from_size_align(9 << 20, 64).unwrap(), 1000);
            assert!((0..1000).all(|i| *s.add(i) == 9));
            a.dealloc(s, Layout::from_size_align(1000, 64).unwrap());
        }
    }

    /// Blocks below 2 MiB are cut from one huge page (no other test uses 256 KiB blocks): eight 256 KiB
    /// blocks fill one 2 MiB-aligned page, each distinct, the ones never used handed out zeroed without a
    /// write, a reused one zeroed again.
    #[test]
    fn small_large_blocks_share_a_huge_page() {
        let a = Retaining;
        let l = Layout::from_size_align(256 << 10, 64).unwrap();
        unsafe {
            let mut blocks: Vec<*mut u8> = (0..HUGE / l.size()).map(|_| a.alloc_zeroed(l)).collect();
            let page = blocks[0] as usize;
            assert!(page.is_multiple_of(HUGE), "the first block starts a huge page");
            blocks.sort();
            for (i, &b) in blocks.iter().enumerate() {
                assert_eq!(b as usize, page + i * l.size(), "block {i} is the page's {i}th quarter-MiB");
                assert!((0..l.size()).step_by(4093).all(|j| *b.add(j) == 0));
                std::ptr::write_bytes(b, 5, l.size());
            }
            a.dealloc(blocks[3], l);
            let again = a.alloc_zeroed(l);
            assert_eq!(again, blocks[3]);
            assert!((0..l.size()).step_by(4093).all(|j| *again.add(j) == 0));
            for &b in &blocks {
                a.dealloc(b, l);
            }
        }
    }
}
