//! `tether-lazyfs --below DIR --mount DIR --control SOCKET`: mounts the lazy
//! file system over `--below` at `--mount` and serves until unmounted or
//! killed. Root only (it mounts with mount(2)); run it in a mount
//! namespace of its own (`unshare --mount --propagation private`) so no
//! mount outlives it.
//!
//! The control socket is created once the mount serves (so its existence
//! says "ready") and takes one command per line, answering one line each:
//! - `power-cut`: forget every write not yet synced; answers
//!   `lost FILES files BYTES bytes`;
//! - `pending`: answers `pending FILES files BYTES bytes`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use fuser::{Config, MountOption, SessionACL};
use tether_lazyfs::fs::{LazyFs, Lost, PowerSwitch};

fn main() {
    if let Err(e) = run() {
        eprintln!("tether-lazyfs: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let (below, mount, control) = parse_args()?;
    let fs = LazyFs::new(&below).map_err(|e| format!("{}: {e}", below.display()))?;
    let switch = fs.power_switch();
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(format!("tether-lazyfs:{}", below.display())),
        MountOption::Subtype("tether-lazyfs".into()),
    ];
    // Programs of any user (the tests' programs run as root, as this does).
    config.acl = SessionACL::All;
    let session = fuser::Session::new(fs, &mount, &config).map_err(|e| {
        format!(
            "cannot mount on {} (root and /dev/fuse needed; Debian's fuse3): {e}",
            mount.display()
        )
    })?;
    let _ = std::fs::remove_file(&control);
    let listener =
        UnixListener::bind(&control).map_err(|e| format!("{}: {e}", control.display()))?;
    std::thread::spawn(move || serve_control(listener, switch));
    eprintln!(
        "tether-lazyfs: {} mounted on {}, control {}",
        below.display(),
        mount.display(),
        control.display()
    );
    session
        .run()
        .map_err(|e| format!("serving {}: {e}", mount.display()))
}

fn parse_args() -> Result<(PathBuf, PathBuf, PathBuf), String> {
    let usage = "usage: tether-lazyfs --below DIR --mount DIR --control SOCKET";
    let (mut below, mut mount, mut control) = (None, None, None);
    let mut args = std::env::args_os().skip(1);
    while let Some(flag) = args.next() {
        let slot = match flag.to_str() {
            Some("--below") => &mut below,
            Some("--mount") => &mut mount,
            Some("--control") => &mut control,
            _ => return Err(format!("unknown argument {flag:?}; {usage}")),
        };
        *slot = Some(PathBuf::from(
            args.next()
                .ok_or_else(|| format!("{flag:?} needs a value; {usage}"))?,
        ));
    }
    match (below, mount, control) {
        (Some(b), Some(m), Some(c)) => Ok((b, m, c)),
        _ => Err(usage.into()),
    }
}

fn serve_control(listener: UnixListener, switch: PowerSwitch) {
    for stream in listener.incoming().flatten() {
        let switch = switch.clone();
        std::thread::spawn(move || {
            let _ = answer(stream, &switch);
        });
    }
}

fn answer(stream: UnixStream, switch: &PowerSwitch) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    for line in BufReader::new(stream).lines() {
        let reply = match line?.trim() {
            "power-cut" => {
                let Lost { files, bytes } = switch.power_cut();
                eprintln!("tether-lazyfs: power cut: lost {files} files, {bytes} bytes");
                format!("lost {files} files {bytes} bytes")
            }
            "pending" => {
                let Lost { files, bytes } = switch.pending();
                format!("pending {files} files {bytes} bytes")
            }
            other => format!("error: unknown command {other:?} (power-cut, pending)"),
        };
        writeln!(writer, "{reply}")?;
    }
    Ok(())
}
