//! Stored shapes of older formats that this build still reads, and how they
//! become today's. Only what changed shape is here: a format-2 client
//! session (kept answers without command fingerprints), in snapshots of
//! format 1 and 2 and in `sm` rows under [`keys::SESSION_V2_PREFIX`]
//! written by builds of formats up to 5.
//!
//! [`keys::SESSION_V2_PREFIX`]: super::keys::SESSION_V2_PREFIX

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::sm::{
    ClientSession, CommandResult, Lock, LockKey, NodeInfo, Pin, PinKey, PodPhase, State,
    StoredAnswer, TtlLease, answer_size,
};

/// A client session as formats 1-5 stored it: answers without fingerprints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClientSessionV2 {
    /// Responses by sequence.
    pub responses: BTreeMap<u64, CommandResult>,
    /// Sequences below this are done.
    pub acknowledged_below: u64,
    /// Committed time of the client's last request.
    pub last_seen_ms: u64,
}

impl From<ClientSessionV2> for ClientSession {
    /// Kept answers carry no fingerprint, so a retry of one is answered as
    /// formats up to 5 answered it.
    fn from(old: ClientSessionV2) -> Self {
        let mut session = ClientSession {
            responses: old
                .responses
                .into_iter()
                .map(|(sequence, result)| {
                    let answer = StoredAnswer {
                        result,
                        fingerprint: None,
                        answered_at: 0,
                    };
                    (sequence, answer)
                })
                .collect(),
            acknowledged_below: old.acknowledged_below,
            last_seen_ms: old.last_seen_ms,
            answer_bytes: 0,
        };
        session.answer_bytes = session.responses.values().map(answer_size).sum();
        session
    }
}

/// The state as snapshots of formats 1 and 2 hold it: [`State`] field for
/// field, in the same order, with [`ClientSessionV2`] sessions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct StateV2 {
    /// See [`State::locks`].
    pub locks: BTreeMap<LockKey, Lock>,
    /// See [`State::leases`].
    pub leases: BTreeMap<u64, TtlLease>,
    /// See [`State::sessions`].
    pub sessions: BTreeMap<String, ClientSessionV2>,
    /// See [`State::now_ms`].
    pub now_ms: u64,
    /// See [`State::pins`].
    pub pins: BTreeMap<PinKey, Pin>,
    /// See [`State::nodes`].
    pub nodes: BTreeMap<String, NodeInfo>,
    /// See [`State::pods`].
    pub pods: BTreeMap<String, PodPhase>,
}

impl From<StateV2> for State {
    fn from(old: StateV2) -> Self {
        State {
            locks: old.locks,
            leases: old.leases,
            sessions: old
                .sessions
                .into_iter()
                .map(|(client, session)| (client, session.into()))
                .collect(),
            now_ms: old.now_ms,
            pins: old.pins.into(),
            nodes: old.nodes,
            pods: old.pods,
            sweep_index: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sm::Reply;
    use crate::store::state_machine::StateMachineStore;
    use crate::store::{CF_SM, decode, encode, keys, open_db};

    /// A database written by a build of format 5 holds its sessions in the
    /// old shape under the old prefix: this build reads them, and moves them
    /// (once) under today's prefix in today's shape.
    #[test]
    fn sessions_of_an_older_build_are_read_and_moved_when_the_database_opens() {
        let dir = tempfile::tempdir().unwrap();
        let old = ClientSessionV2 {
            responses: BTreeMap::from([(5, Ok(Reply::Queued { position: 1 }))]),
            acknowledged_below: 5,
            last_seen_ms: 9,
        };
        let mut old_key = keys::SESSION_V2_PREFIX.to_vec();
        old_key.extend_from_slice(b"client-1");
        {
            let db = open_db(dir.path()).unwrap();
            db.put_cf(db.cf_handle(CF_SM).unwrap(), &old_key, encode(&old))
                .unwrap();
        }
        let expected: ClientSession = old.into();
        for opening in ["first", "second"] {
            let db = open_db(dir.path()).unwrap();
            let store = StateMachineStore::load(db.clone()).unwrap();
            assert_eq!(
                store.handle().read().state.sessions["client-1"],
                expected,
                "{opening} opening"
            );
            let sm = db.cf_handle(CF_SM).unwrap();
            assert!(db.get_cf(sm, &old_key).unwrap().is_none(), "{opening}");
            let moved = db.get_cf(sm, keys::session_key("client-1")).unwrap();
            assert_eq!(
                decode::<ClientSession>(&moved.expect("moved")).unwrap(),
                expected
            );
        }
    }

    /// Guards the field order: a format-2 state encoded by `StateV2` must
    /// decode field for field, and the only shape change is the sessions.
    #[test]
    fn a_format_2_state_becomes_the_same_state_with_unfingerprinted_answers() {
        let mut old = StateV2 {
            now_ms: 77,
            ..Default::default()
        };
        old.sessions.insert(
            "client-1".into(),
            ClientSessionV2 {
                responses: BTreeMap::from([(3, Ok(Reply::Queued { position: 2 }))]),
                acknowledged_below: 3,
                last_seen_ms: 70,
            },
        );
        let state: State = decode::<StateV2>(&encode(&old)).unwrap().into();
        assert_eq!(state.now_ms, 77);
        let session = &state.sessions["client-1"];
        assert_eq!(session.acknowledged_below, 3);
        assert_eq!(session.last_seen_ms, 70);
        assert_eq!(
            session.responses[&3],
            StoredAnswer {
                result: Ok(Reply::Queued { position: 2 }),
                fingerprint: None,
                answered_at: 0,
            }
        );
    }
}
