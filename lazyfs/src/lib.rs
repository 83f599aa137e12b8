//! Tether's lazy file system: a FUSE file system over a directory that
//! keeps every write not yet synced in a cache of its own and forgets it
//! on command, as a power cut does, in the spirit of LazyFS
//! (dsrhaslab/lazyfs). The power-loss tests and the power-loss chaos runs
//! keep replicas' data on it (`tether_kube_testenv::lazyfs` mounts it).
//!
//! [`cache`] is one file's unsynced pages (pure); [`fs`] the file system
//! and what it caches (its module doc is the model a test runs on); the
//! `tether-lazyfs` binary mounts it and takes commands on a Unix socket.

pub mod cache;
pub mod fs;
