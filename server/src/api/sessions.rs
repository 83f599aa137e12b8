//! Who may open a new exactly-once session. The state machine keeps at most
//! [`MAX_SESSIONS`] client sessions cluster-wide; without a quota, one
//! caller sending requests under ever new client ids (a compromised device
//! plugin's certificate) filled the table within the idle hour, and from
//! then on every new client of every identity, the bridge and the scheduler
//! after a restart included, was refused.
//!
//! The leader admits a request that would open a session before proposing
//! it, from its applied state: an identity has at most
//! `--max-sessions-per-identity` sessions, and the last
//! `--reserved-sessions` places of the table go only to the roles the
//! cluster cannot work without (bridge, scheduler, admin, replica). The
//! count is of the applied state, so requests already in flight may take an
//! identity a batch past its quota; the table's own limit, checked in apply,
//! stays exact.
//!
//! [`MAX_SESSIONS`]: crate::sm::MAX_SESSIONS

use crate::auth::{Caller, Role};
use crate::sm::{MAX_SESSIONS, State};

/// The limits, from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct SessionLimits {
    /// Sessions one counted identity may have.
    pub per_identity: usize,
    /// Places at the end of the table for the privileged roles.
    pub reserved: usize,
}

/// Whether `role`'s sessions are counted against its identity's quota:
/// every authenticated role but the operators' and the replicas'.
fn counted(role: &Role) -> bool {
    !matches!(role, Role::Admin | Role::Replica)
}

/// Whether `role` may use the table's reserved places.
fn privileged(role: &Role) -> bool {
    matches!(
        role,
        Role::Bridge | Role::Scheduler | Role::Admin | Role::Replica
    )
}

/// The prefix of every session key of `identity` (`validate::request_id`
/// makes them `<identity>/<client id>`).
pub fn identity_prefix(identity: &str) -> String {
    format!("{identity}/")
}

/// Whether `caller` may open one more session, given its identity's
/// current count and the table's size. `Err` says why not, and what to do.
pub fn admit(
    caller: &Caller,
    identity_sessions: usize,
    table: usize,
    limits: SessionLimits,
) -> Result<(), String> {
    // Without authentication everyone may do everything; only the table's
    // own limit applies.
    let Some(role) = &caller.role else {
        return Ok(());
    };
    // A planted bug for `tests/security.rs` (`sessions-no-quota`, set with
    // `fail::cfg`): no quota, as before issue 34.
    if fail::eval("sessions-no-quota", |_| ()).is_some() {
        return Ok(());
    }
    if counted(role) && identity_sessions >= limits.per_identity {
        return Err(format!(
            "{} (role {role}) already has {identity_sessions} sessions, its quota \
             (tetherd --max-sessions-per-identity {}): reuse one client per process; a session \
             idle for --session-idle is dropped",
            caller.identity, limits.per_identity
        ));
    }
    let open_to_all = MAX_SESSIONS.saturating_sub(limits.reserved);
    if !privileged(role) && table >= open_to_all {
        return Err(format!(
            "the session table holds {table} of {MAX_SESSIONS}; the last {} are kept for the \
             bridge, scheduler and admin roles (tetherd --reserved-sessions)",
            limits.reserved
        ));
    }
    Ok(())
}

/// [`admit`] against `state`, for a request of `caller` whose session key is
/// `client_id`: a session that exists is always admitted.
pub fn admit_in(
    state: &State,
    caller: &Caller,
    client_id: &str,
    limits: SessionLimits,
) -> Result<(), String> {
    if caller.role.is_none() || state.sessions.contains_key(client_id) {
        return Ok(());
    }
    let prefix = identity_prefix(&caller.identity);
    let identity_sessions = state
        .sessions
        .range(prefix.clone()..)
        .take_while(|(key, _)| key.starts_with(&prefix))
        .count();
    admit(caller, identity_sessions, state.sessions.len(), limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(role: Role) -> Caller {
        Caller {
            identity: format!("CN={role}"),
            role: Some(role),
        }
    }

    const LIMITS: SessionLimits = SessionLimits {
        per_identity: 10,
        reserved: 100,
    };

    #[test]
    fn an_identity_at_its_quota_is_refused_and_operators_are_not_counted() {
        let plugin = caller(Role::DevicePlugin {
            node: "node-a".into(),
        });
        assert!(admit(&plugin, 9, 0, LIMITS).is_ok());
        let err = admit(&plugin, 10, 0, LIMITS).unwrap_err();
        assert!(
            err.contains("CN=device-plugin:node-a")
                && err.contains("--max-sessions-per-identity 10"),
            "{err}"
        );
        for counted in [Role::Scheduler, Role::Bridge, Role::Reader] {
            assert!(
                admit(&caller(counted.clone()), 10, 0, LIMITS).is_err(),
                "{counted}"
            );
        }
        for free in [Role::Admin, Role::Replica] {
            assert!(
                admit(&caller(free.clone()), 10_000, 0, LIMITS).is_ok(),
                "{free}"
            );
        }
        assert!(admit(&Caller::anonymous(), 10_000, MAX_SESSIONS, LIMITS).is_ok());
    }

    #[test]
    fn the_reserved_places_go_only_to_the_bridge_scheduler_admin_and_replicas() {
        let open_to_all = MAX_SESSIONS - LIMITS.reserved;
        let plugin = caller(Role::DevicePlugin { node: "n".into() });
        assert!(admit(&plugin, 0, open_to_all - 1, LIMITS).is_ok());
        let err = admit(&plugin, 0, open_to_all, LIMITS).unwrap_err();
        assert!(err.contains("--reserved-sessions"), "{err}");
        assert!(admit(&caller(Role::Reader), 0, open_to_all, LIMITS).is_err());
        for privileged in [Role::Bridge, Role::Scheduler, Role::Admin, Role::Replica] {
            assert!(
                admit(&caller(privileged.clone()), 0, MAX_SESSIONS - 1, LIMITS).is_ok(),
                "{privileged}"
            );
        }
    }

    #[test]
    fn sessions_are_counted_by_identity_prefix_and_an_existing_one_is_admitted() {
        let mut state = State::default();
        for client in ["a", "b", "c"] {
            state
                .sessions
                .insert(format!("CN=scheduler/{client}"), Default::default());
        }
        // Another identity's sessions, sorted right after and before.
        state
            .sessions
            .insert("CN=scheduler0/x".into(), Default::default());
        state
            .sessions
            .insert("CN=bridge/x".into(), Default::default());
        let limits = SessionLimits {
            per_identity: 3,
            reserved: 0,
        };
        let scheduler = caller(Role::Scheduler);
        assert!(admit_in(&state, &scheduler, "CN=scheduler/a", limits).is_ok());
        let err = admit_in(&state, &scheduler, "CN=scheduler/d", limits).unwrap_err();
        assert!(err.contains("already has 3 sessions"), "{err}");
        let limits = SessionLimits {
            per_identity: 4,
            ..limits
        };
        assert!(admit_in(&state, &scheduler, "CN=scheduler/d", limits).is_ok());
    }
}
