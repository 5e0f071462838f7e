//! Zeroed memory straight from the OS (anonymous pages) for the paged KV pool: a page costs
//! nothing until a block on it is first written, and the whole pool goes back to the OS when
//! dropped. The global allocator would hand back recycled memory instead, which it must zero
//! (touching every page) and keeps after the pool is gone.

use std::mem::MaybeUninit;

use burn_std::{AllocationController, AllocationProperty, Bytes};
use memmap2::MmapMut;

/// Anonymous pages holding one buffer.
struct AnonymousPages(MmapMut);

impl AllocationController for AnonymousPages {
    fn alloc_align(&self) -> usize {
        // Mappings start at a page boundary.
        4096
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        let len = self.0.len();
        // SAFETY: the mapping is `len` writable bytes, initialised (zero) by the OS.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), len) }
    }

    fn memory(&self) -> &[MaybeUninit<u8>] {
        // SAFETY: as above, read only.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len()) }
    }
}

/// `len` zero bytes on fresh anonymous pages; `None` when the OS refuses the mapping.
pub(super) fn zeroed(len: usize) -> Option<Bytes> {
    let map = MmapMut::map_anon(len.max(1)).ok()?;
    // SAFETY: the controller's memory is `len` initialised bytes (at least).
    Some(unsafe { Bytes::from_controller(Box::new(AnonymousPages(map)), len) })
}
