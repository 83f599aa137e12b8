//! The revoker: revokes pods that currently hold, as the bridge does when a
//! pod is deleted mid-bind.

use super::*;

/// Revokes a random current holder now and then, like a pod deleted
/// mid-bind.
pub async fn revoker(shared: Arc<Shared>, process: u64, mut rng: Rng) {
    while !shared.stopped() {
        tokio::time::sleep(Duration::from_millis(rng.between(50, 250))).await;
        let victim = {
            let list = shared.holding.lock().unwrap_or_else(|p| p.into_inner());
            (!list.is_empty()).then(|| rng.pick(&list).clone())
        };
        if let Some(uid) = victim {
            shared.revoke(process, &uid).await;
        }
    }
}
