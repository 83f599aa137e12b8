//! What one file has had written since it was last synced, held in memory
//! the way a kernel's page cache holds dirty pages: whole pages as the file
//! now reads, and the size programs see. A sync writes the pages to the
//! file below; a power cut forgets them, so the file below is what the disk
//! kept.
//!
//! Pure: the file below is read through a closure, so the merging of cached
//! pages with the file's older contents is tested here without a mount.

use std::collections::BTreeMap;
use std::io;

/// The unit the cache keeps: a write of one byte caches its whole page, as
/// a kernel's page cache does.
pub const PAGE: u64 = 4096;

/// Reads the file below: fills `buf` from `offset`, with zeros past its end.
pub trait Below {
    fn read_below(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
}

impl<F: FnMut(u64, &mut [u8]) -> io::Result<()>> Below for F {
    fn read_below(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self(offset, buf)
    }
}

/// The part of bytes `at..` that lies in page `index`: `n` bytes from
/// `within` the page.
struct Span {
    index: u64,
    at: u64,
    within: usize,
    n: usize,
}

/// The bytes `offset..end`, page by page.
fn spans(offset: u64, end: u64) -> impl Iterator<Item = Span> {
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let index = at / PAGE;
        let within = at - index * PAGE;
        let n = (PAGE - within).min(end - at);
        let span = Span {
            index,
            at,
            within: within as usize,
            n: n as usize,
        };
        at += n;
        Some(span)
    })
}

/// One file's unsynced writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirty {
    /// Page index to the page's whole contents as programs read them.
    pages: BTreeMap<u64, Box<[u8]>>,
    /// The file's size as programs see it.
    size: u64,
}

impl Dirty {
    /// Nothing unsynced yet, over a file below of `size` bytes.
    pub fn new(size: u64) -> Dirty {
        Dirty {
            pages: BTreeMap::new(),
            size,
        }
    }

    /// The size programs see.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The bytes held: what a power cut would lose at most.
    pub fn cached_bytes(&self) -> u64 {
        self.pages.len() as u64 * PAGE
    }

    /// Writes `data` at `offset`: the pages it touches are read from below
    /// first (where not cached yet), then changed in the cache only.
    pub fn write(&mut self, offset: u64, data: &[u8], below: &mut impl Below) -> io::Result<()> {
        let end = offset + data.len() as u64;
        for Span {
            index,
            at,
            within,
            n,
        } in spans(offset, end)
        {
            let page_start = index * PAGE;
            let page = match self.pages.entry(index) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    let mut fresh = vec![0u8; PAGE as usize].into_boxed_slice();
                    // Below this file's current size only: past it a program
                    // reads zeros, whatever an older, longer file left below.
                    let known = self.size.saturating_sub(page_start).min(PAGE) as usize;
                    if known > 0 {
                        below.read_below(page_start, &mut fresh[..known])?;
                    }
                    e.insert(fresh)
                }
            };
            let source = (at - offset) as usize;
            page[within..within + n].copy_from_slice(&data[source..source + n]);
        }
        self.size = self.size.max(end);
        Ok(())
    }

    /// Reads up to `len` bytes at `offset` as programs see them: cached
    /// pages where there are any, the file below elsewhere, nothing past the
    /// size.
    pub fn read(&self, offset: u64, len: u64, below: &mut impl Below) -> io::Result<Vec<u8>> {
        let end = (offset + len).min(self.size);
        if offset >= end {
            return Ok(Vec::new());
        }
        let mut out = vec![0u8; (end - offset) as usize];
        for Span {
            index,
            at,
            within,
            n,
        } in spans(offset, end)
        {
            let target = &mut out[(at - offset) as usize..(at - offset) as usize + n];
            match self.pages.get(&index) {
                Some(page) => target.copy_from_slice(&page[within..within + n]),
                None => below.read_below(at, target)?,
            }
        }
        Ok(out)
    }

    /// The file was truncated (below too: a size change is metadata, which
    /// this file system passes through at once): pages past the new size
    /// go, and the last page's bytes past it read as zeros if it grows
    /// again.
    pub fn truncate(&mut self, size: u64) {
        let first_gone = size.div_ceil(PAGE);
        self.pages.split_off(&first_gone);
        if !size.is_multiple_of(PAGE)
            && let Some(page) = self.pages.get_mut(&(size / PAGE))
        {
            page[(size % PAGE) as usize..].fill(0);
        }
        self.size = size;
    }

    /// What a sync writes below, in order: each cached page's bytes up to
    /// the size, at its offset. After writing them all the file below reads
    /// as this one does.
    pub fn extents(&self) -> impl Iterator<Item = (u64, &[u8])> {
        self.pages.iter().filter_map(|(&index, page)| {
            let start = index * PAGE;
            let n = self.size.saturating_sub(start).min(PAGE) as usize;
            (n > 0).then(|| (start, &page[..n]))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file below held in memory.
    struct Memory(Vec<u8>);

    impl Below for Memory {
        fn read_below(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            buf.fill(0);
            let start = (offset as usize).min(self.0.len());
            let end = (start + buf.len()).min(self.0.len());
            buf[..end - start].copy_from_slice(&self.0[start..end]);
            Ok(())
        }
    }

    impl Memory {
        /// What a sync of `dirty` leaves below.
        fn synced(mut self, dirty: &Dirty) -> Vec<u8> {
            self.0.resize(dirty.size() as usize, 0);
            for (offset, bytes) in dirty.extents() {
                self.0[offset as usize..offset as usize + bytes.len()].copy_from_slice(bytes);
            }
            self.0
        }
    }

    #[test]
    fn a_write_reads_back_over_the_older_contents_and_leaves_below_alone() {
        let mut below = Memory(b"0123456789".to_vec());
        let mut dirty = Dirty::new(10);
        dirty.write(3, b"abc", &mut below).unwrap();
        assert_eq!(dirty.read(0, 100, &mut below).unwrap(), b"012abc6789");
        assert_eq!(below.0, b"0123456789");
        assert_eq!(dirty.size(), 10);
    }

    #[test]
    fn writes_across_pages_and_past_the_end_grow_the_file() {
        let mut below = Memory(vec![7u8; 5000]);
        let mut dirty = Dirty::new(5000);
        let data: Vec<u8> = (0..9000u32).map(|i| (i % 251) as u8).collect();
        dirty.write(4000, &data, &mut below).unwrap();
        assert_eq!(dirty.size(), 13_000);
        let read = dirty.read(0, 20_000, &mut below).unwrap();
        assert_eq!(read.len(), 13_000);
        assert!(read[..4000].iter().all(|&b| b == 7));
        assert_eq!(&read[4000..], &data[..]);
        // A read that starts in the middle of an uncached page.
        assert_eq!(dirty.read(10, 5, &mut below).unwrap(), vec![7u8; 5]);
        assert_eq!(below.synced(&dirty), read);
    }

    #[test]
    fn a_sync_leaves_below_what_programs_read() {
        let mut below = Memory(b"hello world".to_vec());
        let mut dirty = Dirty::new(11);
        dirty.write(6, b"there, world", &mut below).unwrap();
        dirty.write(0, b"H", &mut below).unwrap();
        let seen = dirty.read(0, 1 << 20, &mut below).unwrap();
        assert_eq!(seen, b"Hello there, world");
        assert_eq!(below.synced(&dirty), seen);
    }

    #[test]
    fn a_truncated_then_grown_file_reads_zeros_where_it_was_cut() {
        let mut below = Memory(Vec::new());
        let mut dirty = Dirty::new(0);
        dirty.write(0, &[9u8; 6000], &mut below).unwrap();
        // The truncation also happened below (metadata passes through).
        dirty.truncate(100);
        below.0.truncate(100);
        assert_eq!(dirty.size(), 100);
        assert_eq!(dirty.cached_bytes(), PAGE);
        dirty.write(5000, b"x", &mut below).unwrap();
        let read = dirty.read(0, 10_000, &mut below).unwrap();
        assert_eq!(read.len(), 5001);
        assert!(read[..100].iter().all(|&b| b == 9));
        assert!(read[100..5000].iter().all(|&b| b == 0));
        assert_eq!(read[5000], b'x');
        assert_eq!(below.synced(&dirty), read);
    }

    #[test]
    fn bytes_past_a_shorter_size_are_not_read_from_below() {
        // The file below is longer than the size programs see (it was cut
        // in the cache's view): a new page must not bring its old bytes back.
        let mut below = Memory(vec![5u8; 8192]);
        let mut dirty = Dirty::new(10);
        dirty.write(20, b"z", &mut below).unwrap();
        let read = dirty.read(0, 100, &mut below).unwrap();
        assert_eq!(&read[..10], &[5u8; 10]);
        assert!(read[10..20].iter().all(|&b| b == 0));
        assert_eq!(read[20], b'z');
    }

    #[test]
    fn reads_past_the_size_are_empty() {
        let mut below = Memory(b"abc".to_vec());
        let dirty = Dirty::new(3);
        assert!(dirty.read(3, 10, &mut below).unwrap().is_empty());
        assert!(dirty.read(100, 10, &mut below).unwrap().is_empty());
        assert_eq!(dirty.read(1, 10, &mut below).unwrap(), b"bc");
    }
}
