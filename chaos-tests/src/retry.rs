//! The retrier: two bind attempts at one pod, through two clients, as when
//! kube-scheduler gives up on a bind (its `httpTimeout`, a restart) and
//! binds the pod again through another extender replica while the first
//! attempt still runs.
//!
//! Each round takes a fresh lock: the first attempt (process `p`, the
//! workload's client) takes it for pod `p`, pod `x` queues behind
//! (process `p + 2`), then the second attempt (process `p + 1`, a client of
//! its own) acquires the same pod: from format 9 it takes the hold over
//! with a new token. The first attempt then leaves as the extender does
//! when its caller is gone, withdrawing and releasing its own token (in an
//! order drawn from the seed), and the second uses the shadow resource
//! with its token and releases. `x` is granted after that.
//!
//! What the checkers see: two processes answered the same token of one pod
//! (`sm-acquire-shares-attempts`, the rule before format 9), or a
//! withdrawal that gave back the second attempt's token
//! (`sm-withdraw-ignores-client`), is an `attempts` violation; and
//! `mutual_exclusion`, `fencing`, `tokens` and `fifo` read the same log.

use std::sync::Arc;
use std::time::Duration;

use crate::history::{Outcome, Value};
use crate::rng::Rng;
use crate::workers::{Shared, use_and_release};

/// How long `x` may wait.
const WAIT: Duration = Duration::from_secs(3);

/// The retrier's rounds (its processes are `process` to `process + 2`),
/// until stopped.
pub async fn retrier(shared: Arc<Shared>, process: u64, mut rng: Rng) {
    // The order of the first attempt's withdrawal and release, drawn apart
    // from the rest so that it follows from the seed alone.
    let mut order = rng.fork(0xA77);
    let mut round = 0u64;
    while !shared.stopped() {
        round += 1;
        let key = shared.lock(&format!("t{process}-{round}"));
        shared.track_lock(&key);
        let name = key.name.clone();
        let (p, x) = (format!("{name}p"), format!("{name}x"));
        let Outcome::Ok(Value::Granted(first)) =
            shared.acquire(process, &key, &p, Duration::ZERO).await
        else {
            shared.revoke(process, &p).await;
            continue;
        };
        let (queued, is_queued) = tokio::sync::oneshot::channel();
        let waiter_x = {
            let (shared, key, x) = (shared.clone(), key.clone(), x.clone());
            tokio::spawn(async move {
                shared
                    .acquire_on_lease(process + 2, &key, &x, WAIT, 0, Some(queued))
                    .await
            })
        };
        let _ = is_queued.await;
        let second = shared
            .acquire_through(
                &shared.second_client,
                process + 1,
                &key,
                &p,
                Duration::ZERO,
                0,
                None,
            )
            .await;
        let withdraw = || shared.withdraw(&shared.client, process, &key, &p);
        let release = || shared.release(process, &key, &p, first);
        if order.percent(50) {
            withdraw().await;
            release().await;
        } else {
            release().await;
            withdraw().await;
        }
        match second {
            Outcome::Ok(Value::Granted(token)) => {
                use_and_release(&shared, process + 1, &key, &p, token, &mut rng).await;
            }
            _ => {
                shared.revoke(process + 1, &p).await;
            }
        }
        match waiter_x.await.expect("x") {
            Outcome::Ok(Value::Granted(token)) => {
                use_and_release(&shared, process + 2, &key, &x, token, &mut rng).await;
            }
            Outcome::Ok(_) | Outcome::Fail(_) => {}
            Outcome::Unknown(_) | Outcome::Pending => {
                shared.revoke(process + 2, &x).await;
            }
        }
    }
}
