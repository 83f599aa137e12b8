//! Membership and leadership: learners and voters (a change waits for an
//! earlier one to commit instead of failing), leader transfer by hand
//! (openraft 0.9 has none), snapshots on request.

use openraft::async_runtime::WatchReceiver as _;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use openraft::BasicNode;

use super::Replica;
use super::raft_errors::from_raft_error;
use crate::error::{ApiError, Result};

/// How long a membership change waits for an earlier one to commit before
/// it reports the cluster busy.
const MEMBERSHIP_BUSY_WAIT: Duration = Duration::from_secs(10);

type MembershipResult = std::result::Result<
    openraft::raft::ClientWriteResponse<crate::raft::TypeConfig>,
    openraft::error::RaftError<
        crate::raft::TypeConfig,
        openraft::error::ClientWriteError<crate::raft::TypeConfig>,
    >,
>;

impl Replica {
    /// Hands leadership to `target`, a voter. openraft 0.9 has no leader transfer,
    /// so this does it by hand: wait until the target has every entry, stop
    /// heartbeats so the followers' leader lease lapses, then tell the target to
    /// start an election at once (before any other follower's election timer
    /// fires). Returns the new leader's id.
    pub async fn transfer_leader(&self, target: u64) -> Result<u64> {
        self.require_leader()?;
        if target == self.id {
            return Ok(self.id);
        }
        let metrics = self.raft.metrics().borrow_watched().clone();
        let membership = metrics.membership_config.membership().clone();
        if !membership.voter_ids().any(|id| id == target) {
            return Err(ApiError::FailedPrecondition(format!(
                "node {target} is not a voter; promote it with ChangeMembership first"
            )));
        }
        let addr = membership
            .get_node(&target)
            .map(|n| n.addr.clone())
            .unwrap_or_default();
        let timeout = self.config.election_timeout_max() * 4;
        if self
            .transferring
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err(ApiError::FailedPrecondition(
                "a leadership transfer is already in progress".into(),
            ));
        }
        // New writes are refused from here on, so the log stops growing.
        let result = self.hand_over(target, &addr, timeout).await;
        self.transferring.store(false, Ordering::SeqCst);
        result
    }

    /// Steps 1-3 of a transfer, with writes already held off.
    async fn hand_over(&self, target: u64, addr: &str, timeout: Duration) -> Result<u64> {
        // 1. The target must have the whole log, or it cannot win the election.
        let caught_up = tokio::time::timeout(timeout, async {
            let mut rx = self.raft.metrics();
            loop {
                let (last, matched) = {
                    let m = rx.borrow_watched();
                    let matched = m
                        .replication
                        .as_ref()
                        .and_then(|r| r.get(&target).copied().flatten());
                    (m.last_log_index, matched.map(|l| l.index))
                };
                if last.is_some() && matched >= last {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        if caught_up.is_err() {
            return Err(ApiError::Unavailable(format!(
                "node {target} did not catch up with the log within {timeout:?}; try again"
            )));
        }

        // 2. Let the followers' leader lease lapse, 3. then the target elects.
        self.raft.runtime_config().heartbeat(false);
        let result = async {
            tokio::time::sleep(self.config.election_timeout_max() + Duration::from_millis(50))
                .await;
            // Dialed and marked like any Raft message.
            let mut client = self.dialer.raft_client(target, addr).ok_or_else(|| {
                ApiError::Unavailable(format!(
                    "node {target} has an address that cannot be dialed: {addr}"
                ))
            })?;
            tokio::time::timeout(
                timeout,
                client.timeout_now(self.dialer.message(target, Vec::new())),
            )
            .await
            .map_err(|_| {
                ApiError::Unavailable(format!("node {target} did not answer within {timeout:?}"))
            })?
            .map_err(|e| ApiError::Unavailable(format!("node {target} refused to elect: {e}")))?;
            let mut rx = self.raft.metrics();
            tokio::time::timeout(timeout, async {
                loop {
                    let leader = rx.borrow_watched().current_leader;
                    if leader.is_some() && leader != Some(self.id) {
                        return leader;
                    }
                    if rx.changed().await.is_err() {
                        return None;
                    }
                }
            })
            .await
            .ok()
            .flatten()
            .ok_or_else(|| {
                ApiError::Unavailable(format!(
                    "node {target} did not take over within {timeout:?}"
                ))
            })
        }
        .await;
        self.raft.runtime_config().heartbeat(true);
        result
    }

    /// Runs a membership change, and when openraft refuses it because an
    /// earlier change has not committed yet (the second, uniform step of a
    /// joint change is still in flight), waits for that change to be applied
    /// and tries again: an operator's "add this learner" should not fail
    /// because the previous command's last entry is a few milliseconds from
    /// commit.
    ///
    /// The same for a joint change whose second step openraft 0.10 refused
    /// because another change was appended between its two steps (the
    /// second step requires the membership to be still the joint one): the
    /// change is run again once the other one is applied. Every change
    /// this runs names its goal (these voters, these learners), so running
    /// it again reaches the same membership. Other errors, and a change
    /// still pending after [`MEMBERSHIP_BUSY_WAIT`], are returned as they
    /// are.
    async fn change_when_settled<F, Fut>(&self, change: F) -> MembershipResult
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = MembershipResult>,
    {
        let give_up = tokio::time::Instant::now() + MEMBERSHIP_BUSY_WAIT;
        loop {
            let result = change().await;
            let pending = match &result {
                Err(openraft::error::RaftError::APIError(
                    openraft::error::ClientWriteError::ChangeMembershipError(
                        openraft::error::ChangeMembershipError::InProgress(busy),
                    ),
                )) => busy.membership_log_id,
                Err(openraft::error::RaftError::APIError(
                    openraft::error::ClientWriteError::PreconditionFailed(
                        openraft::error::PreconditionFailed::LastMembershipLogIdMismatch {
                            actual,
                            ..
                        },
                    ),
                )) => *actual,
                _ => return result,
            };
            let remaining = give_up.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() {
                return result;
            }
            let index = pending.map_or(0, |id| id.index);
            tracing::info!(
                index,
                "a membership change is committing; waiting to apply it"
            );
            let applied = tokio::time::timeout(
                remaining,
                crate::raft::wait_for_metrics(&self.raft, |m| {
                    m.last_applied.as_ref().is_some_and(|a| a.index >= index)
                }),
            )
            .await;
            if !matches!(applied, Ok(Ok(_))) {
                return result;
            }
        }
    }

    /// Adds `id` at `addr` as a learner; with `blocking`, returns once it
    /// has caught up. The index of the membership entry.
    pub async fn add_learner(&self, id: u64, addr: &str, blocking: bool) -> Result<u64> {
        let node = BasicNode {
            addr: addr.to_string(),
        };
        let response = self
            .change_when_settled(|| self.raft.add_learner(id, node.clone(), blocking))
            .await
            .map_err(from_raft_error)?;
        Ok(response.log_id.index)
    }

    /// Removes the learners `remove`. The index of the membership entry.
    pub async fn remove_learners(&self, remove: &BTreeSet<u64>) -> Result<u64> {
        let response = self
            .change_when_settled(|| {
                self.raft
                    .change_membership(openraft::ChangeMembers::RemoveNodes(remove.clone()), false)
            })
            .await
            .map_err(from_raft_error)?;
        Ok(response.log_id.index)
    }

    /// Makes `voters` the voter set, keeping voters that leave it as
    /// learners when `retain`. The index of the membership entry.
    pub async fn change_voters(&self, voters: &BTreeSet<u64>, retain: bool) -> Result<u64> {
        let response = self
            .change_when_settled(|| self.raft.change_membership(voters.clone(), retain))
            .await
            .map_err(from_raft_error)?;
        Ok(response.log_id.index)
    }

    /// Whether this replica has Raft state (a log, a snapshot or a vote).
    pub async fn is_initialized(&self) -> anyhow::Result<bool> {
        Ok(self.raft.is_initialized().await?)
    }

    /// Starts a new cluster of `members` (id to address): true when it did,
    /// false when Raft state appeared meanwhile (another replica started
    /// it and reached this one).
    pub async fn initialize(&self, members: BTreeMap<u64, String>) -> anyhow::Result<bool> {
        let nodes: BTreeMap<u64, BasicNode> = members
            .into_iter()
            .map(|(id, addr)| (id, BasicNode { addr }))
            .collect();
        match self.raft.initialize(nodes).await {
            Ok(()) => Ok(true),
            Err(openraft::error::RaftError::APIError(
                openraft::error::InitializeError::NotAllowed(_),
            )) => Ok(false),
            Err(err) => Err(anyhow::Error::new(err).context("cannot initialize the cluster")),
        }
    }

    /// Builds a snapshot holding everything applied now; its index.
    pub async fn snapshot(&self) -> Result<u64> {
        let applied = self.applied_and_leader().0;
        self.raft
            .trigger()
            .snapshot()
            .await
            .map_err(|e| ApiError::Unavailable(format!("this replica has stopped: {e}")))?;
        let snapshot = self
            .raft
            .wait(Some(Duration::from_secs(60)))
            .metrics(
                |m| m.snapshot.map_or(0, |l| l.index) >= applied,
                "snapshot built",
            )
            .await
            .map_err(|e| ApiError::Unavailable(format!("snapshot not built: {e}")))?;
        Ok(snapshot.snapshot.map_or(0, |l| l.index))
    }
}
