//! env-devices: member processes on GPUs their environment is not
//! attached to.
//!
//! genv's order: environments in snapshot order, each one's members in
//! snapshot order. A stray (a process whose environment is gone or not
//! its user's) is no member of any environment and is not named, as genv
//! does not name a process whose environment does not exist.

use super::attribution::Attribution;
use super::{Finding, Rule, Violation};
use crate::model::{HostId, Indices};

pub(super) fn evaluate(host: &HostId, a: &Attribution) -> Vec<Violation> {
    let snap = a.snapshot();
    let mut out = Vec::new();
    for (i, env) in snap.envs.iter().enumerate() {
        for p in a.members(i) {
            let unallowed: Indices = p.indices().filter(|d| !a.is_attached(i, *d)).collect();
            if !unallowed.is_empty() {
                let finding = Finding::NonAttachedDevices {
                    host: host.clone(),
                    pid: p.pid,
                    eid: env.eid.clone(),
                    devices: unallowed,
                };
                out.push(Violation::terminating(
                    Rule::EnvDevices,
                    finding,
                    host,
                    p.pid,
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{EnvId, GpuIndex, HostSnapshot, Pid};

    #[test]
    fn multi_gpu_process_names_only_unattached_gpus() {
        let snap = HostSnapshot {
            processes: vec![
                proc_(10, Some("a"), &[(0, mib(1)), (1, mib(1)), (2, mib(1))]),
                proc_(11, Some("a"), &[(0, mib(1))]),
                proc_(12, Some("ghost"), &[(3, mib(1)), (0, mib(1))]),
                proc_(13, None, &[(3, mib(1))]),
            ],
            envs: vec![env("a", Some("alice"), None)].into(),
            devices: devices(4, &[(0, "a")]).into(),
            truth: None,
            ..Default::default()
        };
        let v = evaluate(
            &HostId("h".into()),
            &Attribution::of(&snap, &Default::default()),
        );
        assert_eq!(v.len(), 1, "the orphan 12 is left alone, as genv does");
        assert_eq!(
            v[0].finding,
            Finding::NonAttachedDevices {
                host: HostId("h".into()),
                pid: Pid(10),
                eid: EnvId("a".into()),
                devices: smallvec::smallvec![GpuIndex(1), GpuIndex(2)],
            }
        );
    }

    #[test]
    fn env_with_no_devices_has_all_its_processes_named() {
        let snap = HostSnapshot {
            processes: vec![proc_(10, Some("a"), &[(0, mib(1))])],
            envs: vec![env("a", None, None)].into(),
            devices: devices(1, &[]).into(),
            truth: None,
            ..Default::default()
        };
        assert_eq!(
            evaluate(
                &HostId("h".into()),
                &Attribution::of(&snap, &Default::default())
            )
            .len(),
            1
        );
    }
}
