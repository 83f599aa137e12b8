//! LazyFS as the power-loss tests use it: what was fsynced survives a
//! cleared cache and what was not is gone, for the test process's own
//! writes and for a program started in the mount's namespace; and no mount
//! is left behind.

use std::io::Write;

use tether_kube_testenv::lazyfs::{self, LazyFs};

#[test]
fn a_cleared_cache_keeps_what_was_fsynced_and_loses_the_rest() {
    if !lazyfs::available_or_skip("a_cleared_cache_keeps_what_was_fsynced_and_loses_the_rest") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let fs = LazyFs::mount(
        work.path(),
        "one",
        &work.path().join("backing"),
        &work.path().join("mount"),
    )
    .unwrap();
    let synced = fs.path().join("synced");
    let mut file = std::fs::File::create(&synced).unwrap();
    file.write_all(b"kept").unwrap();
    file.sync_all().unwrap();
    drop(file);
    std::fs::write(fs.path().join("unsynced"), b"lost").unwrap();
    // A program in the namespace writes through the same mount.
    let status = fs
        .command(std::path::Path::new("/bin/sh"))
        .arg("-c")
        .arg(format!(
            "printf lost > {0}/by-program && printf kept > {0}/by-program-synced && sync {0}/by-program-synced",
            fs.mount_point().display()
        ))
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(std::fs::read(fs.path().join("unsynced")).unwrap(), b"lost");

    fs.clear_cache().unwrap();
    assert_eq!(std::fs::read(&synced).unwrap(), b"kept");
    assert_eq!(std::fs::read(fs.path().join("unsynced")).unwrap(), b"");
    assert_eq!(std::fs::read(fs.path().join("by-program")).unwrap(), b"");
    assert_eq!(
        std::fs::read(fs.path().join("by-program-synced")).unwrap(),
        b"kept"
    );
    // The backing directory holds what the disk kept.
    assert_eq!(
        std::fs::read(work.path().join("backing/synced")).unwrap(),
        b"kept"
    );

    let mount = work.path().join("mount");
    drop(fs);
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mountinfo.contains(&mount.display().to_string()),
        "the mount was never in this namespace"
    );
}
