//! orphaned-env-processes (ours, opt-in with `--orphans-as-non-env`,
//! under non-env-processes): a GPU process whose `GENV_ENVIRONMENT_ID`
//! names no environment of the host is taken as outside genv. genv leaves
//! such a job alone, and so do we by default: a `nohup` job outlives its
//! environment's record, and any user can empty `envs.json`. But a made-up
//! id then takes any job out of non-env-processes; this rule closes that,
//! with its own grace (the ladder warns the job's owner first), so that a
//! real orphan's owner has time to act. A job seen orphaned whose record
//! has come back is taken too unless its environment is attached to every
//! device it runs on (its owner restored it, with `genv activate --id`;
//! restoring it so is as good as running in an environment: its devices
//! count toward the owner's cap), so that writing a record back for a
//! made-up id, which anyone can, is no way out either. A job carrying an id
//! that processes of several users carry (contested) may be the victim of
//! the others, and stays alone.
//!
//! The limit, as for a removed attachment (`docs/safety.md`): another user
//! who removes a job's record makes it an orphan; its owner is warned, and
//! has the grace to restore it.

use super::attribution::{Attribution, Standing, Stray};
use super::{Finding, Rule, Violation};
use crate::model::HostId;

pub(super) fn evaluate(host: &HostId, a: &Attribution) -> Vec<Violation> {
    a.snapshot()
        .processes
        .iter()
        .enumerate()
        .filter(|(pi, p)| match a.standing(*pi) {
            Standing::Stray(Stray::Orphaned) => true,
            Standing::Stray(Stray::Reclaimed) => match p.owner.eid().and_then(|e| a.env(e)) {
                Some(i) => !p.indices().all(|d| a.is_attached(i, d)),
                None => true,
            },
            _ => false,
        })
        .filter_map(|(pi, p)| {
            let finding = Finding::OrphanedEnvProcess {
                host: host.clone(),
                pid: p.pid,
                eid: p.owner.eid()?.clone(),
                user: a.user_of(pi).map(|u| u.into_owned()),
            };
            Some(Violation::terminating(
                Rule::OrphanedEnvProcesses,
                finding,
                host,
                p.pid,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{HostSnapshot, HostTruth, Pid};

    #[test]
    fn names_jobs_whose_id_names_no_environment_only() {
        let snap = HostSnapshot {
            processes: vec![
                proc_(1, Some("bogus123"), &[(0, mib(10))]),
                proc_(2, Some("e"), &[(0, mib(10))]),
                proc_(3, None, &[(1, mib(10))]),
            ],
            envs: vec![env("e", Some("alice"), None)].into(),
            devices: devices(2, &[(0, "e")]).into(),
            truth: Some(HostTruth {
                user_names: [(1000, "alice".to_string())]
                    .into_iter()
                    .map(|(k, v)| (k, v.into()))
                    .collect(),
                ..HostTruth::default()
            }),
            ..Default::default()
        };
        let host = HostId("h".into());
        let v = evaluate(&host, &Attribution::of(&snap, &Default::default()));
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].rule, Rule::OrphanedEnvProcesses);
        assert_eq!(
            v[0].finding,
            Finding::OrphanedEnvProcess {
                host: host.clone(),
                pid: Pid(1),
                eid: crate::model::EnvId("bogus123".into()),
                user: Some("alice".into()),
            }
        );
        // Seen orphaned before, with a record appearing since: still one,
        // until its environment is attached where it runs (restored).
        let mut later = snap.clone();
        std::sync::Arc::make_mut(&mut later.envs).push(env("bogus123", Some("alice"), None));
        let orphans = [(Pid(1), 1001)].into_iter().collect();
        assert_eq!(evaluate(&host, &Attribution::of(&later, &orphans)).len(), 1);
        later.devices = devices(2, &[(0, "e"), (0, "bogus123")]).into();
        assert!(evaluate(&host, &Attribution::of(&later, &orphans)).is_empty());
    }
}
