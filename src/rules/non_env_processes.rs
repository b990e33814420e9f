//! non-env-processes: GPU processes outside any environment, as genv
//! has it: those without a `GENV_ENVIRONMENT_ID`. A process that carries
//! an id naming no environment of its user (a stray) is not named, as
//! genv does not: any user can empty `envs.json`, and a `nohup` job
//! outlives its environment's record. A process whose environ could not
//! be read is never named.

use super::attribution::{Attribution, Standing};
use super::{Finding, Rule, Violation};
use crate::model::HostId;

pub(super) fn evaluate(host: &HostId, a: &Attribution) -> Vec<Violation> {
    a.snapshot()
        .processes
        .iter()
        .enumerate()
        .filter(|(pi, _)| *a.standing(*pi) == Standing::NoEnv)
        .map(|(_, p)| {
            let finding = Finding::NonEnvProcess {
                host: host.clone(),
                pid: p.pid,
            };
            Violation::terminating(Rule::NonEnvProcesses, finding, host, p.pid)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{HostSnapshot, Owner, Pid, Process};
    use crate::rules::Action;

    #[test]
    fn names_env_less_processes_only() {
        let mut unreadable: Process = proc_(4, None, &[(0, mib(1))]);
        unreadable.owner = Owner::Unknown("permission denied".into());
        let snap = HostSnapshot {
            processes: vec![
                proc_(1, None, &[(0, mib(10))]),
                proc_(2, Some("e"), &[(0, mib(10))]),
                proc_(3, Some("ghost"), &[(1, mib(10))]),
                unreadable,
            ],
            envs: vec![env("e", Some("alice"), None)].into(),
            devices: devices(2, &[(0, "e")]).into(),
            truth: None,
            ..Default::default()
        };
        let host = HostId("h".into());
        let v = evaluate(&host, &Attribution::of(&snap, &Default::default()));
        let pids: Vec<Pid> = v
            .iter()
            .flat_map(|v| &v.actions)
            .map(|a| match a {
                Action::Terminate { pid, .. } => *pid,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            pids,
            vec![Pid(1)],
            "the orphan 3 is left alone, as genv does"
        );
    }

    #[test]
    fn compliant_host_has_no_violation() {
        let snap = HostSnapshot {
            processes: vec![proc_(2, Some("e"), &[(0, mib(10))])],
            envs: vec![env("e", None, None)].into(),
            devices: devices(1, &[(0, "e")]).into(),
            truth: None,
            ..Default::default()
        };
        assert!(evaluate(
            &HostId("h".into()),
            &Attribution::of(&snap, &Default::default())
        )
        .is_empty());
    }
}
