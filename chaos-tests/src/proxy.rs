//! A fault-injecting TCP proxy for one directed replica link (`from` dials
//! `to` through it; replicas are told with `--peer-dial`). The harness flips
//! its mode: pass, blackhole (a partition: nothing flows and connections
//! hang, as with dropped packets), delay every chunk, or reset connections
//! at random. Raft's traffic over a link is request/response inside
//! connections the `from` side opens, so blackholing `a -> b` while `b -> a`
//! passes is a one-way (asymmetric) partition.
//!
//! Every mode change closes the link's open connections: bytes are never
//! dropped from the middle of a stream (that would corrupt HTTP/2 framing
//! rather than model a network), the dialer reconnects instead.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::rng::Rng;

/// What a link does to traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkMode {
    /// Forward everything at once.
    Pass,
    /// Forward nothing; new connections are accepted and then hang.
    Blackhole,
    /// Hold every chunk this long before forwarding it (order is kept).
    Delay(Duration),
    /// Forward, but close a connection with this chance per chunk
    /// (per mille): drops and resets.
    Flaky(u32),
}

/// One directed link's proxy; stops when dropped.
pub struct Proxy {
    /// Where `from` dials.
    pub addr: SocketAddr,
    mode: watch::Sender<(LinkMode, u64)>,
    generation: AtomicU64,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr, seed: u64) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, mode_rx) = watch::channel((LinkMode::Pass, 0));
        let task = tokio::spawn(accept_loop(listener, target, mode_rx, seed));
        Ok(Proxy {
            addr,
            mode,
            generation: AtomicU64::new(0),
            task,
        })
    }

    /// Switches the mode; open connections are closed.
    pub fn set(&self, mode: LinkMode) {
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        self.mode.send_replace((mode, generation));
    }

    /// The current mode.
    pub fn mode(&self) -> LinkMode {
        self.mode.borrow().0
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    mode: watch::Receiver<(LinkMode, u64)>,
    seed: u64,
) {
    let rng = Arc::new(std::sync::Mutex::new(Rng::new(seed)));
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            continue;
        };
        let salt = rng.lock().unwrap_or_else(|p| p.into_inner()).next_u64();
        tasks.spawn(serve(inbound, target, mode.clone(), Rng::new(salt)));
        // Reap finished connections so the set does not grow.
        while tasks.try_join_next().is_some() {}
    }
}

/// One connection: lives until either side closes or the mode changes.
async fn serve(
    inbound: TcpStream,
    target: SocketAddr,
    mut mode: watch::Receiver<(LinkMode, u64)>,
    rng: Rng,
) {
    let (current, _) = *mode.borrow_and_update();
    let changed = async move {
        let _ = mode.changed().await;
    };
    if current == LinkMode::Blackhole {
        // Hold the connection open and silent until the partition heals.
        changed.await;
        return;
    }
    let Ok(Ok(outbound)) =
        tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(target)).await
    else {
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    let mut rng_back = rng.clone();
    rng_back.next_u64();
    tokio::select! {
        _ = pump(in_read, out_write, current, rng) => {}
        _ = pump(out_read, in_write, current, rng_back) => {}
        _ = changed => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: LinkMode,
    mut rng: Rng,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        match mode {
            LinkMode::Delay(delay) => tokio::time::sleep(delay).await,
            LinkMode::Flaky(per_mille) if rng.below(1000) < u64::from(per_mille) => return,
            _ => {}
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server behind the proxy: pass echoes, blackhole does not,
    /// healing works again, delay holds the answer back.
    #[tokio::test]
    async fn modes_change_what_gets_through() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = echo.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = socket.read(&mut buf).await {
                        if n == 0 || socket.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let proxy = Proxy::start(echo_addr, 1).await.unwrap();
        async fn round_trip(addr: SocketAddr, wait: Duration) -> Option<Duration> {
            let started = std::time::Instant::now();
            let mut socket = TcpStream::connect(addr).await.ok()?;
            socket.write_all(b"ping").await.ok()?;
            let mut buf = [0u8; 4];
            tokio::time::timeout(wait, socket.read_exact(&mut buf))
                .await
                .ok()?
                .ok()?;
            (&buf == b"ping").then(|| started.elapsed())
        }
        let long = Duration::from_secs(30);
        assert!(round_trip(proxy.addr, long).await.is_some());
        proxy.set(LinkMode::Blackhole);
        assert!(
            round_trip(proxy.addr, Duration::from_millis(300))
                .await
                .is_none()
        );
        proxy.set(LinkMode::Pass);
        assert!(round_trip(proxy.addr, long).await.is_some());
        proxy.set(LinkMode::Delay(Duration::from_millis(100)));
        let took = round_trip(proxy.addr, long).await.expect("delayed echo");
        assert!(
            took >= Duration::from_millis(200),
            "two delayed hops: {took:?}"
        );
    }
}
