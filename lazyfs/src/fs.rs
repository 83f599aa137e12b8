//! The file system: a pass-through to a directory below, except that file
//! data written and not yet synced stays in [`Dirty`] caches until a sync
//! writes it below, or a power cut ([`LazyFs::power_cut`]) forgets it.
//!
//! What is cached and what is not (the model a power-loss test runs on):
//! - **File data** written with `write` is cached per inode until `fsync`
//!   or `fdatasync` of any handle of that file (coreutils' `sync FILE`
//!   opens it read-only, which counts), or a write through a handle opened
//!   with `O_SYNC` or `O_DSYNC`. Closing a file (`flush`, `release`) syncs
//!   nothing, as on a real disk. Reads see the cache.
//! - **Metadata** passes through at once and survives a power cut: create,
//!   mkdir, unlink, rename, link, symlink, chmod, chown, times, and size
//!   changes by `truncate` (including `O_TRUNC`). So does a directory's
//!   `fsync`, which has nothing left to do. This is LazyFS's model too
//!   (dsrhaslab/lazyfs caches file data, not the namespace). It is kind to
//!   a program that forgets to sync a directory after a rename, and strict
//!   where it matters here: a file created and renamed into place before
//!   its data was synced comes back from a power cut empty.
//! - "Below" is durable: a sync writes the pages into the directory below
//!   and does not fsync it there, since the machine's own disk is not what
//!   a test cuts the power of.
//!
//! How the kernel is kept from caching on its own: every open is
//! `FOPEN_DIRECT_IO` (reads and writes all come here; `mmap` of a file is
//! refused) and entries and attributes are given no time to live (after a
//! power cut the next `stat` asks again). Locks are left to the kernel
//! (it keeps POSIX locks itself when the file system does not take them).
//!
//! Inodes are kept as `O_PATH` descriptors of the objects below (the way
//! libfuse's `passthrough_ll` keeps them), so renames need no path
//! bookkeeping, and an inode with unsynced data stays open below, so its
//! number cannot be reused while its cache lives.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{DirEntryExt, FileExt, FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use rustix::fs::{AtFlags, CWD, Mode, OFlags, Stat};

use crate::cache::Dirty;

/// No time to live: the kernel asks again each time, so nothing it kept
/// outlives a power cut.
const NO_TTL: Duration = Duration::ZERO;

/// What a power cut forgot.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Lost {
    /// Files that had unsynced writes.
    pub files: u64,
    /// Cached bytes forgotten (whole pages).
    pub bytes: u64,
}

/// The mounted file system.
pub struct LazyFs {
    state: Arc<Mutex<State>>,
}

/// The power switch of a mounted [`LazyFs`] (for the control socket's
/// thread while the session owns the file system).
#[derive(Clone)]
pub struct PowerSwitch {
    state: Arc<Mutex<State>>,
}

struct State {
    nodes: HashMap<u64, Node>,
    /// (device, inode below) to this file system's inode number.
    by_below: HashMap<(u64, u64), u64>,
    next_ino: u64,
    handles: HashMap<u64, Handle>,
    next_handle: u64,
}

struct Node {
    /// An `O_PATH` descriptor of the object below.
    below: OwnedFd,
    key: (u64, u64),
    /// The kernel's count of references (lookups less forgets).
    lookups: u64,
    /// Open handles of this inode.
    opens: u64,
    dirty: Option<Dirty>,
}

enum Handle {
    File {
        file: File,
        /// Opened with `O_SYNC` or `O_DSYNC`: every write is synced.
        sync_writes: bool,
        /// Opened with `O_APPEND`: every write goes to the end, wherever
        /// the kernel thought the end was.
        append: bool,
    },
    Directory {
        entries: Vec<(u64, FileType, OsString)>,
    },
}

impl LazyFs {
    /// A file system over the directory `below`.
    pub fn new(below: &Path) -> io::Result<LazyFs> {
        let root = rustix::fs::open(
            below,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let stat = rustix::fs::fstat(&root)?;
        let key = key_of(&stat);
        let mut nodes = HashMap::new();
        nodes.insert(
            INodeNo::ROOT.0,
            Node {
                below: root,
                key,
                // The root is never forgotten.
                lookups: 1,
                opens: 0,
                dirty: None,
            },
        );
        Ok(LazyFs {
            state: Arc::new(Mutex::new(State {
                nodes,
                by_below: HashMap::from([(key, INodeNo::ROOT.0)]),
                next_ino: INodeNo::ROOT.0 + 1,
                handles: HashMap::new(),
                next_handle: 1,
            })),
        })
    }

    /// The switch that cuts this file system's power.
    pub fn power_switch(&self) -> PowerSwitch {
        PowerSwitch {
            state: Arc::clone(&self.state),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }
}

/// A panic in one request must not wedge the mount: each operation leaves
/// the state consistent.
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl PowerSwitch {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// The power cut: every write not yet synced is forgotten; what the
    /// directory below holds is what programs read from now on.
    pub fn power_cut(&self) -> Lost {
        let mut state = self.state();
        let mut lost = Lost::default();
        for node in state.nodes.values_mut() {
            if let Some(dirty) = node.dirty.take() {
                lost.files += 1;
                lost.bytes += dirty.cached_bytes();
            }
        }
        let idle: Vec<u64> = state
            .nodes
            .iter()
            .filter(|(_, n)| n.lookups == 0 && n.opens == 0)
            .map(|(&ino, _)| ino)
            .collect();
        for ino in idle {
            state.evict(ino);
        }
        lost
    }

    /// Unsynced files and bytes now.
    pub fn pending(&self) -> Lost {
        let state = self.state();
        let mut pending = Lost::default();
        for dirty in state.nodes.values().filter_map(|n| n.dirty.as_ref()) {
            pending.files += 1;
            pending.bytes += dirty.cached_bytes();
        }
        pending
    }
}

impl State {
    fn node(&self, ino: INodeNo) -> io::Result<&Node> {
        self.nodes.get(&ino.0).ok_or_else(stale)
    }

    fn node_mut(&mut self, ino: INodeNo) -> io::Result<&mut Node> {
        self.nodes.get_mut(&ino.0).ok_or_else(stale)
    }

    /// Looks `name` up in `parent` below and counts a reference to it.
    fn lookup(&mut self, parent: INodeNo, name: &OsStr) -> io::Result<FileAttr> {
        let fd = rustix::fs::openat(
            &self.node(parent)?.below,
            name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        self.adopt(fd)
    }

    /// Counts a reference to the object `fd` (`O_PATH`) is of: a new inode,
    /// or one already known (then `fd` is closed).
    fn adopt(&mut self, fd: OwnedFd) -> io::Result<FileAttr> {
        let stat = rustix::fs::fstat(&fd)?;
        let key = key_of(&stat);
        let ino = match self.by_below.get(&key) {
            Some(&ino) => ino,
            None => {
                let ino = self.next_ino;
                self.next_ino += 1;
                self.nodes.insert(
                    ino,
                    Node {
                        below: fd,
                        key,
                        lookups: 0,
                        opens: 0,
                        dirty: None,
                    },
                );
                self.by_below.insert(key, ino);
                ino
            }
        };
        let node = self.nodes.get_mut(&ino).expect("just found or inserted");
        node.lookups += 1;
        Ok(attr(ino, &stat, node.dirty.as_ref()))
    }

    fn attr(&self, ino: INodeNo) -> io::Result<FileAttr> {
        let node = self.node(ino)?;
        let stat = rustix::fs::fstat(&node.below)?;
        Ok(attr(ino.0, &stat, node.dirty.as_ref()))
    }

    /// Forgets an inode nothing refers to any more, unless it still holds
    /// unsynced data of a file that exists below (its descriptor then keeps
    /// the inode number from being reused until a sync or a power cut).
    fn evict(&mut self, ino: u64) {
        let Some(node) = self.nodes.get(&ino) else {
            return;
        };
        if ino == INodeNo::ROOT.0 || node.lookups > 0 || node.opens > 0 {
            return;
        }
        let linked = rustix::fs::fstat(&node.below).is_ok_and(|s| s.st_nlink > 0);
        if node.dirty.is_some() && linked {
            return;
        }
        let node = self.nodes.remove(&ino).expect("checked above");
        self.by_below.remove(&node.key);
    }

    /// Writes an inode's cached pages below (the sync).
    fn sync(&mut self, ino: INodeNo) -> io::Result<()> {
        let node = self.node_mut(ino)?;
        let Some(dirty) = node.dirty.as_ref() else {
            return Ok(());
        };
        let file = reopen(&node.below, OFlags::WRONLY)?;
        for (offset, bytes) in dirty.extents() {
            file.write_all_at(bytes, offset)?;
        }
        // The size too: the extents reach it unless the file was grown by
        // a truncate that already passed through.
        if file.metadata()?.len() < dirty.size() {
            file.set_len(dirty.size())?;
        }
        node.dirty = None;
        Ok(())
    }

    fn truncate(&mut self, ino: INodeNo, size: u64) -> io::Result<()> {
        let node = self.node_mut(ino)?;
        reopen(&node.below, OFlags::WRONLY)?.set_len(size)?;
        if let Some(dirty) = node.dirty.as_mut() {
            dirty.truncate(size);
        }
        Ok(())
    }

    fn open_handle(&mut self, ino: INodeNo, flags: i32) -> io::Result<u64> {
        let writes = flags & libc_flags::ACCMODE != libc_flags::RDONLY;
        // Read and write where writes are asked for: a partial page's older
        // contents are read through the same handle.
        let access = if writes { OFlags::RDWR } else { OFlags::RDONLY };
        let node = self.node_mut(ino)?;
        let file = reopen(&node.below, access)?;
        node.opens += 1;
        let sync_writes = flags & (libc_flags::SYNC | libc_flags::DSYNC) != 0;
        let append = flags & libc_flags::APPEND != 0;
        let fh = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(
            fh,
            Handle::File {
                file,
                sync_writes,
                append,
            },
        );
        if flags & libc_flags::TRUNC != 0 && writes {
            self.truncate(ino, 0)?;
        }
        Ok(fh)
    }

    fn file(&self, fh: FileHandle) -> io::Result<(&File, bool)> {
        match self.handles.get(&fh.0) {
            Some(Handle::File {
                file, sync_writes, ..
            }) => Ok((file, *sync_writes)),
            _ => Err(rustix::io::Errno::BADF.into()),
        }
    }

    fn read(&self, ino: INodeNo, fh: FileHandle, offset: u64, size: u32) -> io::Result<Vec<u8>> {
        let (file, _) = self.file(fh)?;
        let node = self.node(ino)?;
        let mut below = |at: u64, buf: &mut [u8]| read_below(file, at, buf);
        match &node.dirty {
            Some(dirty) => Ok(dirty.read(offset, u64::from(size), &mut below)?),
            None => {
                let mut buf = vec![0u8; size as usize];
                let n = read_upto(file, offset, &mut buf)?;
                buf.truncate(n);
                Ok(buf)
            }
        }
    }

    fn write(&mut self, ino: INodeNo, fh: FileHandle, offset: u64, data: &[u8]) -> io::Result<()> {
        let State { nodes, handles, .. } = self;
        let Some(Handle::File {
            file,
            sync_writes,
            append,
        }) = handles.get(&fh.0)
        else {
            return Err(rustix::io::Errno::BADF.into());
        };
        let node = nodes.get_mut(&ino.0).ok_or_else(stale)?;
        let dirty = match &mut node.dirty {
            Some(dirty) => dirty,
            empty => empty.insert(Dirty::new(file.metadata()?.len())),
        };
        let offset = if *append { dirty.size() } else { offset };
        let mut below = |at: u64, buf: &mut [u8]| read_below(file, at, buf);
        dirty.write(offset, data, &mut below)?;
        if *sync_writes {
            self.sync(ino)?;
        }
        Ok(())
    }
}

/// The flags of `open(2)` this file system looks at (x86_64 and aarch64
/// Linux share them).
mod libc_flags {
    pub const ACCMODE: i32 = 0o3;
    pub const RDONLY: i32 = 0;
    pub const EXCL: i32 = 0o200;
    pub const TRUNC: i32 = 0o1000;
    pub const APPEND: i32 = 0o2000;
    pub const DSYNC: i32 = 0o10000;
    pub const SYNC: i32 = 0o4010000;
}

/// An inode this file system no longer knows.
fn stale() -> io::Error {
    rustix::io::Errno::STALE.into()
}

fn key_of(stat: &Stat) -> (u64, u64) {
    (stat.st_dev, stat.st_ino)
}

/// `/proc/self/fd/N`: opens, changes modes and times of the object an
/// `O_PATH` descriptor is of.
fn proc_path(fd: &OwnedFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

fn reopen(below: &OwnedFd, access: OFlags) -> io::Result<File> {
    let fd = rustix::fs::openat(
        CWD,
        proc_path(below),
        access | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    Ok(File::from(fd))
}

/// Fills `buf` from `offset`, zeros past the end of the file.
fn read_below(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let n = read_upto(file, offset, buf)?;
    buf[n..].fill(0);
    Ok(())
}

fn read_upto(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn time(secs: i64, nanos: u64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nanos as u32)
    } else {
        UNIX_EPOCH
    }
}

fn kind_of(mode: u32) -> FileType {
    match rustix::fs::FileType::from_raw_mode(mode) {
        rustix::fs::FileType::Directory => FileType::Directory,
        rustix::fs::FileType::Symlink => FileType::Symlink,
        rustix::fs::FileType::Fifo => FileType::NamedPipe,
        rustix::fs::FileType::CharacterDevice => FileType::CharDevice,
        rustix::fs::FileType::BlockDevice => FileType::BlockDevice,
        rustix::fs::FileType::Socket => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

fn attr(ino: u64, stat: &Stat, dirty: Option<&Dirty>) -> FileAttr {
    let size = dirty.map_or(stat.st_size as u64, Dirty::size);
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: time(stat.st_atime, stat.st_atime_nsec),
        mtime: time(stat.st_mtime, stat.st_mtime_nsec),
        ctime: time(stat.st_ctime, stat.st_ctime_nsec),
        crtime: UNIX_EPOCH,
        kind: kind_of(stat.st_mode),
        perm: (stat.st_mode & 0o7777) as u16,
        nlink: stat.st_nlink as u32,
        uid: stat.st_uid,
        gid: stat.st_gid,
        rdev: stat.st_rdev as u32,
        blksize: 4096,
        flags: 0,
    }
}

fn timespec(time: Option<TimeOrNow>) -> rustix::fs::Timespec {
    match time {
        None => rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_OMIT,
        },
        Some(TimeOrNow::Now) => rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_NOW,
        },
        Some(TimeOrNow::SpecificTime(t)) => {
            let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
            rustix::fs::Timespec {
                tv_sec: since.as_secs() as i64,
                tv_nsec: i64::from(since.subsec_nanos()),
            }
        }
    }
}

fn answer_empty(reply: ReplyEmpty, result: io::Result<()>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e.into()),
    }
}

fn answer_entry(reply: ReplyEntry, result: io::Result<FileAttr>) {
    match result {
        Ok(attr) => reply.entry(&NO_TTL, &attr, Generation(0)),
        Err(e) => reply.error(e.into()),
    }
}

impl Filesystem for LazyFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.state().lookup(parent, name) {
            Ok(attr) => reply.entry(&NO_TTL, &attr, Generation(0)),
            Err(e) => reply.error(e.into()),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let mut state = self.state();
        if let Some(node) = state.nodes.get_mut(&ino.0) {
            node.lookups = node.lookups.saturating_sub(nlookup);
            state.evict(ino.0);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.state().attr(ino) {
            Ok(attr) => reply.attr(&NO_TTL, &attr),
            Err(e) => reply.error(e.into()),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut state = self.state();
        let result = (|| -> io::Result<FileAttr> {
            let path = proc_path(&state.node(ino)?.below);
            if let Some(mode) = mode {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & 0o7777))?;
            }
            if uid.is_some() || gid.is_some() {
                rustix::fs::chownat(
                    &state.node(ino)?.below,
                    "",
                    uid.map(rustix::fs::Uid::from_raw),
                    gid.map(rustix::fs::Gid::from_raw),
                    AtFlags::EMPTY_PATH,
                )?;
            }
            if let Some(size) = size {
                state.truncate(ino, size)?;
            }
            if atime.is_some() || mtime.is_some() {
                let times = rustix::fs::Timestamps {
                    last_access: timespec(atime),
                    last_modification: timespec(mtime),
                };
                rustix::fs::utimensat(CWD, &path, &times, AtFlags::empty())?;
            }
            state.attr(ino)
        })();
        match result {
            Ok(attr) => reply.attr(&NO_TTL, &attr),
            Err(e) => reply.error(e.into()),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let state = self.state();
        let result = state
            .node(ino)
            .and_then(|n| Ok(rustix::fs::readlinkat(&n.below, "", Vec::new())?));
        match result {
            Ok(target) => reply.data(target.as_bytes()),
            Err(e) => reply.error(e.into()),
        }
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut state = self.state();
        let result = (|| {
            rustix::fs::mkdirat(
                &state.node(parent)?.below,
                name,
                Mode::from_raw_mode(mode & !umask & 0o7777),
            )?;
            state.lookup(parent, name)
        })();
        answer_entry(reply, result);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let state = self.state();
        let result = state
            .node(parent)
            .and_then(|p| Ok(rustix::fs::unlinkat(&p.below, name, AtFlags::empty())?));
        answer_empty(reply, result);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let state = self.state();
        let result = state
            .node(parent)
            .and_then(|p| Ok(rustix::fs::unlinkat(&p.below, name, AtFlags::REMOVEDIR)?));
        answer_empty(reply, result);
    }

    fn symlink(
        &self,
        _req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let mut state = self.state();
        let result = (|| {
            rustix::fs::symlinkat(target, &state.node(parent)?.below, link_name)?;
            state.lookup(parent, link_name)
        })();
        answer_entry(reply, result);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let state = self.state();
        let result = (|| -> io::Result<()> {
            rustix::fs::renameat_with(
                &state.node(parent)?.below,
                name,
                &state.node(newparent)?.below,
                newname,
                rustix::fs::RenameFlags::from_bits_retain(flags.bits()),
            )?;
            Ok(())
        })();
        answer_empty(reply, result);
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let mut state = self.state();
        let result = (|| {
            rustix::fs::linkat(
                &state.node(ino)?.below,
                "",
                &state.node(newparent)?.below,
                newname,
                AtFlags::EMPTY_PATH,
            )?;
            state.lookup(newparent, newname)
        })();
        answer_entry(reply, result);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self.state().open_handle(ino, flags.0) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e.into()),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut state = self.state();
        let result = (|| {
            // Created below at once (metadata passes through), empty.
            let exclusive = if flags & libc_flags::EXCL != 0 {
                OFlags::EXCL
            } else {
                OFlags::empty()
            };
            let created = rustix::fs::openat(
                &state.node(parent)?.below,
                name,
                OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC | exclusive,
                Mode::from_raw_mode(mode & !umask & 0o7777),
            )?;
            drop(created);
            let attr = state.lookup(parent, name)?;
            let fh = state.open_handle(attr.ino, flags)?;
            Ok::<_, io::Error>((state.attr(attr.ino)?, fh))
        })();
        match result {
            Ok((attr, fh)) => reply.created(
                &NO_TTL,
                &attr,
                Generation(0),
                FileHandle(fh),
                FopenFlags::FOPEN_DIRECT_IO,
            ),
            Err(e) => reply.error(e.into()),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.state().read(ino, fh, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e.into()),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.state().write(ino, fh, offset, data) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e.into()),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) makes nothing durable.
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut state = self.state();
        if state.handles.remove(&fh.0).is_some()
            && let Some(node) = state.nodes.get_mut(&ino.0)
        {
            node.opens = node.opens.saturating_sub(1);
            state.evict(ino.0);
        }
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.state().sync(ino) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e.into()),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut state = self.state();
        let result = (|| -> io::Result<u64> {
            let path = proc_path(&state.node(ino)?.below);
            let mut entries = vec![
                (ino.0, FileType::Directory, OsString::from(".")),
                (ino.0, FileType::Directory, OsString::from("..")),
            ];
            for entry in std::fs::read_dir(&path)? {
                let entry = entry?;
                let file_type = entry.file_type()?;
                let kind = if file_type.is_dir() {
                    FileType::Directory
                } else if file_type.is_symlink() {
                    FileType::Symlink
                } else if file_type.is_fifo() {
                    FileType::NamedPipe
                } else if file_type.is_socket() {
                    FileType::Socket
                } else if file_type.is_char_device() {
                    FileType::CharDevice
                } else if file_type.is_block_device() {
                    FileType::BlockDevice
                } else {
                    FileType::RegularFile
                };
                entries.push((entry.ino(), kind, entry.file_name()));
            }
            let fh = state.next_handle;
            state.next_handle += 1;
            state.handles.insert(fh, Handle::Directory { entries });
            Ok(fh)
        })();
        match result {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e.into()),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let state = self.state();
        let Some(Handle::Directory { entries }) = state.handles.get(&fh.0) else {
            reply.error(Errno::EBADF);
            return;
        };
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            // The offset of the entry after this one.
            if reply.add(INodeNo(*ino), i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.state().handles.remove(&fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // The namespace already passed through (see the module doc).
        reply.ok();
    }

    fn statfs(&self, _req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        let state = self.state();
        let result = state
            .node(ino)
            .and_then(|n| Ok(rustix::fs::fstatvfs(n.below.as_fd())?));
        match result {
            Ok(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            Err(e) => reply.error(e.into()),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // Programs here run as root; existence is all there is to check.
        match self.state().node(ino) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e.into()),
        }
    }
}
