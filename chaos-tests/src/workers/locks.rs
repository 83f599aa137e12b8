//! The try-lock workers (no queue; the shadow resource with fencing
//! tokens) and the queue workers (one lock's FIFO queue).

use super::*;

/// Try-acquire, fenced read-modify-write, release; until stopped.
pub async fn try_lock_worker(
    shared: Arc<Shared>,
    process: u64,
    locks: Vec<pb::LockKey>,
    mut rng: Rng,
) {
    let mut attempt = 0;
    while !shared.stopped() {
        attempt += 1;
        let key = rng.pick(&locks).clone();
        let event_key = lock_event_key(&key);
        let uid = format!("{}-p{process}-{attempt}", shared.prefix);
        match shared.acquire(process, &key, &uid, Duration::ZERO).await {
            Outcome::Ok(Value::Granted(token)) => {
                shared.set_holding(&uid, true);
                if let Some(read) = shared.shadow.read(&event_key, token) {
                    tokio::time::sleep(Duration::from_millis(rng.between(0, 4))).await;
                    shared.shadow.write(&event_key, token, read);
                }
                shared.set_holding(&uid, false);
                if !matches!(
                    shared.release(process, &key, &uid, token).await,
                    Outcome::Ok(_)
                ) {
                    shared.revoke(process, &uid).await;
                }
            }
            Outcome::Ok(_) | Outcome::Fail(_) => {
                tokio::time::sleep(Duration::from_millis(rng.between(1, 5))).await;
            }
            Outcome::Unknown(_) | Outcome::Pending => {
                // Maybe granted: do not leave the lock held by a pod that
                // will never release it.
                shared.revoke(process, &uid).await;
            }
        }
    }
}

/// Queue for one lock, hold briefly, release; until stopped.
pub async fn queue_worker(shared: Arc<Shared>, process: u64, key: pb::LockKey, mut rng: Rng) {
    let mut attempt = 0;
    while !shared.stopped() {
        attempt += 1;
        let uid = format!("{}-q{process}-{attempt}", shared.prefix);
        match shared
            .acquire(process, &key, &uid, Duration::from_secs(3))
            .await
        {
            Outcome::Ok(Value::Granted(token)) => {
                shared.set_holding(&uid, true);
                tokio::time::sleep(Duration::from_millis(rng.between(1, 8))).await;
                shared.set_holding(&uid, false);
                if !matches!(
                    shared.release(process, &key, &uid, token).await,
                    Outcome::Ok(_)
                ) {
                    shared.revoke(process, &uid).await;
                }
            }
            Outcome::Ok(_) | Outcome::Fail(_) => {}
            Outcome::Unknown(_) | Outcome::Pending => {
                shared.revoke(process, &uid).await;
            }
        }
    }
}
