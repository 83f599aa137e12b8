//! One deadline for a whole operation (`tether_client::deadline`): inside
//! `within`, a call that cannot be served gives up at the caller's deadline
//! with DEADLINE_EXCEEDED, not after its own retry budget; `unbounded`
//! lifts it for clean-up. The replica here is an address nothing listens
//! on, so every attempt fails and the client retries.

use std::time::{Duration, Instant};

use tether_client::proto::LockKey;
use tether_client::{Client, Error, Options, deadline};

/// A loopback address with nothing listening on it: port 1, which no test
/// binds (they take ports the kernel picks). A port picked free and let go
/// was once taken by another test's HTTP server while this one ran, and
/// the client got its 404 instead of a refused connection.
fn dead_endpoint() -> String {
    "127.0.0.1:1".to_string()
}

fn client(retry_timeout: Duration) -> Client {
    Client::new(
        [dead_endpoint()],
        Options {
            call_timeout: Duration::from_secs(1),
            retry_timeout,
            ..Options::default()
        },
    )
    .unwrap()
}

fn key() -> LockKey {
    LockKey {
        scope: "gpu-bind".into(),
        name: "node-1".into(),
    }
}

#[tokio::test]
async fn a_call_inside_a_deadline_gives_up_at_the_deadline_not_after_its_retry_budget() {
    // A retry budget far beyond the deadline: only the deadline can end the
    // call in time.
    let client = client(Duration::from_secs(120));
    let started = Instant::now();
    let result = deadline::within(
        started + Duration::from_millis(500),
        client.release(&key(), "pod-a", 7, tether_client::proto::Outcome::Failed),
    )
    .await;
    let elapsed = started.elapsed();
    assert!(
        matches!(&result, Err(Error::DeadlineExceeded(m)) if m.contains("deadline")),
        "{result:?}"
    );
    assert!(
        elapsed < Duration::from_secs(60),
        "gave up after {elapsed:?}"
    );
    // Several calls in one operation share the one deadline: the second
    // finds it passed at once.
    let result = deadline::within(started + Duration::from_millis(500), async {
        let _ = client.holder(&key()).await;
        client.holder(&key()).await
    })
    .await;
    assert!(
        matches!(result, Err(Error::DeadlineExceeded(_))),
        "{result:?}"
    );
}

#[tokio::test]
async fn clean_up_inside_a_deadline_runs_on_its_own_budget() {
    let client = client(Duration::from_secs(2));
    let started = Instant::now();
    let result = deadline::within(
        started + Duration::from_millis(100),
        deadline::unbounded(client.holder(&key())),
    )
    .await;
    // Not cut at 100 ms: it retried for its own 2 s, then gave up as a call
    // does without a deadline.
    assert!(matches!(result, Err(Error::Unavailable(_))), "{result:?}");
    assert!(started.elapsed() >= Duration::from_secs(1));
}
