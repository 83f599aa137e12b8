//! The UID of the node object under each node name, as the extender's
//! watch of the nodes' metadata sees it. A bind takes the node's lock and
//! its device claims for that object (Tether's format 10: the acquire and
//! the claim carry the UID, `ForNodeObjects`), so that when a node is
//! deleted and re-created under its name while the bridge is away, what a
//! bind takes for the new machine is refused until Tether has the new
//! object registered, rather than taken under the old one's registration
//! and ended by its `Gone` when the bridge comes back (issue 62 case 3).
//!
//! A watch, not a read per bind: kube-scheduler's own view of the nodes is
//! a watch too, and the bind path already makes its reads
//! (`docs/architecture.md`). A name the watch has not seen yet, or one
//! whose watch is down, is taken for no object in particular (unchecked, as
//! before); a re-create the watch has not delivered yet is taken for the
//! old object, within the watch's delay.

use std::collections::HashMap;
use std::sync::RwLock;

use k8s_openapi::api::core::v1::Node;

/// Node name to the UID of the object last seen under it.
#[derive(Debug, Default)]
pub struct NodeObjects {
    uids: RwLock<HashMap<String, String>>,
}

impl NodeObjects {
    /// The UID of the object under `node`, or "" when none has been seen.
    pub fn uid_of(&self, node: &str) -> String {
        self.read().get(node).cloned().unwrap_or_default()
    }

    /// An object `uid` exists under `node` (added, changed, or listed).
    pub fn seen(&self, node: &str, uid: &str) {
        self.uids
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string(), uid.to_string());
    }

    /// Object `uid` under `node` was deleted (a later object under the
    /// name, already seen, stays).
    pub fn deleted(&self, node: &str, uid: &str) {
        let mut uids = self.uids.write().unwrap_or_else(|p| p.into_inner());
        if uids.get(node).is_some_and(|seen| seen == uid) {
            uids.remove(node);
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, String>> {
        self.uids.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps the map current from a watch of the nodes' metadata, until
    /// dropped; a failed watch backs off and resumes (kube-rs' watcher
    /// relists when it must).
    pub async fn follow(&self, client: kube::Client) {
        use futures::TryStreamExt as _;
        use kube::runtime::WatchStreamExt as _;
        use kube::runtime::watcher;
        let nodes: kube::Api<kube::core::PartialObjectMeta<Node>> = kube::Api::all(client);
        let events = watcher(nodes, watcher::Config::default()).default_backoff();
        futures::pin_mut!(events);
        loop {
            let event = match events.try_next().await {
                Ok(Some(event)) => event,
                Ok(None) => return,
                Err(err) => {
                    tracing::warn!(%err, "the extender's node watch failed; it backs off and resumes (until then binds name the node objects last seen)");
                    continue;
                }
            };
            match event {
                watcher::Event::Apply(node) | watcher::Event::InitApply(node) => {
                    if let (Some(name), Some(uid)) = (&node.metadata.name, &node.metadata.uid) {
                        self.seen(name, uid);
                    }
                }
                watcher::Event::Delete(node) => {
                    if let (Some(name), Some(uid)) = (&node.metadata.name, &node.metadata.uid) {
                        self.deleted(name, uid);
                    }
                }
                watcher::Event::Init | watcher::Event::InitDone => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_carries_the_last_object_seen_and_a_stale_delete_leaves_it() {
        let objects = NodeObjects::default();
        assert_eq!(objects.uid_of("gpu-1"), "");
        objects.seen("gpu-1", "old");
        assert_eq!(objects.uid_of("gpu-1"), "old");
        // Re-created: the new object is seen before the old one's delete
        // arrives (a relist), or after it.
        objects.seen("gpu-1", "new");
        objects.deleted("gpu-1", "old");
        assert_eq!(objects.uid_of("gpu-1"), "new");
        objects.deleted("gpu-1", "new");
        assert_eq!(objects.uid_of("gpu-1"), "");
    }
}
