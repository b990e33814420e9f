//! non-env-processes: GPU processes outside any environment.
//!
//! Differs from genv in one way: a process whose `GENV_ENVIRONMENT_ID`
//! names no environment on its host counts as outside one (genv lets it
//! through). A process whose environ could not be read is never named.

use super::{in_unknown_env, Action, Finding, Rule, Violation};
use crate::model::{HostId, HostSnapshot, Owner};

pub(super) fn evaluate(host: &HostId, snap: &HostSnapshot) -> Vec<Violation> {
    snap.processes
        .iter()
        .filter_map(|p| {
            let finding = match (&p.owner, in_unknown_env(snap, p)) {
                (Owner::NoEnv, _) => Finding::NonEnvProcess {
                    host: host.clone(),
                    pid: p.pid,
                },
                (_, Some(eid)) => Finding::UnknownEnvProcess {
                    host: host.clone(),
                    pid: p.pid,
                    eid: eid.clone(),
                },
                _ => return None,
            };
            Some(Violation {
                rule: Rule::NonEnvProcesses,
                finding,
                actions: vec![Action::Terminate {
                    host: host.clone(),
                    pid: p.pid,
                }],
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{Pid, Process};

    #[test]
    fn names_env_less_and_unknown_env_processes_only() {
        let mut unreadable: Process = proc_(4, None, &[(0, mib(1))]);
        unreadable.owner = Owner::Unknown("permission denied".into());
        let snap = HostSnapshot {
            processes: vec![
                proc_(1, None, &[(0, mib(10))]),
                proc_(2, Some("e"), &[(0, mib(10))]),
                proc_(3, Some("ghost"), &[(1, mib(10))]),
                unreadable,
            ],
            envs: vec![env("e", Some("alice"), None)],
            devices: devices(2, &[(0, "e")]),
            truth: None,
        };
        let host = HostId("h".into());
        let v = evaluate(&host, &snap);
        let pids: Vec<Pid> = v
            .iter()
            .flat_map(|v| &v.actions)
            .map(|a| match a {
                Action::Terminate { pid, .. } => *pid,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(pids, vec![Pid(1), Pid(3)]);
        assert!(matches!(v[1].finding, Finding::UnknownEnvProcess { .. }));
    }

    #[test]
    fn compliant_host_has_no_violation() {
        let snap = HostSnapshot {
            processes: vec![proc_(2, Some("e"), &[(0, mib(10))])],
            envs: vec![env("e", None, None)],
            devices: devices(1, &[(0, "e")]),
            truth: None,
        };
        assert!(evaluate(&HostId("h".into()), &snap).is_empty());
    }
}
