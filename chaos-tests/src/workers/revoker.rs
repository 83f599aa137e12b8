//! The revoker: revokes pods that currently hold, as the bridge does when a
//! pod is deleted mid-bind; and deletes pods as their acquire goes out.

use super::*;

/// Revokes a random current holder now and then, like a pod deleted
/// mid-bind. One round in two instead deletes a pod as its acquire of
/// `race_lock`, which no other worker takes, goes out
/// ([`acquire_racing_its_revoke`]). The racing revoke is sent as process
/// `process + 1`.
pub async fn revoker(shared: Arc<Shared>, process: u64, race_lock: pb::LockKey, mut rng: Rng) {
    let mut raced = 0;
    while !shared.stopped() {
        tokio::time::sleep(Duration::from_millis(rng.between(50, 250))).await;
        if rng.below(2) == 0 {
            raced += 1;
            let uid = format!("{}-r{process}-{raced}", shared.prefix);
            acquire_racing_its_revoke(&shared, process, &race_lock, &uid).await;
            continue;
        }
        let victim = {
            let list = shared.holding.lock().unwrap_or_else(|p| p.into_inner());
            (!list.is_empty()).then(|| rng.pick(&list).clone())
        };
        if let Some(uid) = victim {
            shared.revoke(process, &uid).await;
        }
    }
}

/// A pod deleted while it binds (the bridge's report racing the
/// scheduler's acquire): the try-acquire of a free lock and the pod's
/// revoke are sent at once, so that under load they often share a batch entry (format 11),
/// where apply must refuse the revoke if the acquire before it was granted
/// (the lock would be granted again under the same token: the `tokens`
/// checker's "ended in the entry that granted it"). A hold the revoke did
/// not end (it came first) is released.
async fn acquire_racing_its_revoke(shared: &Shared, process: u64, key: &pb::LockKey, uid: &str) {
    let (acquired, _) = tokio::join!(
        shared.acquire(process, key, uid, Duration::ZERO),
        shared.revoke(process + 1, uid)
    );
    match acquired {
        Outcome::Ok(Value::Granted(token)) => {
            if !matches!(
                shared.release(process, key, uid, token).await,
                Outcome::Ok(_)
            ) {
                shared.revoke(process, uid).await;
            }
        }
        Outcome::Unknown(_) | Outcome::Pending => {
            shared.revoke(process, uid).await;
        }
        Outcome::Ok(_) | Outcome::Fail(_) => {}
    }
}
