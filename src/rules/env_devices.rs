//! env-devices: processes on GPUs their environment is not attached to.
//!
//! genv's order: environments in snapshot order, each one's processes in
//! snapshot order. Then (our addition) processes whose environment does not
//! exist on the host: none of their GPUs is attached to it.

use super::{in_unknown_env, Action, Finding, Rule, Violation};
use crate::model::{EnvId, GpuIndex, HostId, HostSnapshot, Pid};

pub(super) fn evaluate(host: &HostId, snap: &HostSnapshot) -> Vec<Violation> {
    let violation = |pid: Pid, eid: &EnvId, devices: Vec<GpuIndex>| Violation {
        rule: Rule::EnvDevices,
        finding: Finding::NonAttachedDevices {
            host: host.clone(),
            pid,
            eid: eid.clone(),
            devices,
        },
        actions: vec![Action::Terminate {
            host: host.clone(),
            pid,
        }],
    };
    let mut out = Vec::new();
    for env in &snap.envs {
        let allowed = snap.attached(&env.eid);
        for p in snap.processes_of(&env.eid) {
            let unallowed: Vec<GpuIndex> = p.indices().filter(|i| !allowed.contains(i)).collect();
            if !unallowed.is_empty() {
                out.push(violation(p.pid, &env.eid, unallowed));
            }
        }
    }
    for p in &snap.processes {
        if let Some(eid) = in_unknown_env(snap, p) {
            out.push(violation(p.pid, eid, p.indices().collect()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;

    #[test]
    fn multi_gpu_process_names_only_unattached_gpus() {
        let snap = HostSnapshot {
            processes: vec![
                proc_(10, Some("a"), &[(0, mib(1)), (1, mib(1)), (2, mib(1))]),
                proc_(11, Some("a"), &[(0, mib(1))]),
                proc_(12, Some("ghost"), &[(3, mib(1)), (0, mib(1))]),
                proc_(13, None, &[(3, mib(1))]),
            ],
            envs: vec![env("a", Some("alice"), None)],
            devices: devices(4, &[(0, "a")]),
            truth: None,
        };
        let v = evaluate(&HostId("h".into()), &snap);
        assert_eq!(v.len(), 2);
        assert_eq!(
            v[0].finding,
            Finding::NonAttachedDevices {
                host: HostId("h".into()),
                pid: Pid(10),
                eid: EnvId("a".into()),
                devices: vec![GpuIndex(1), GpuIndex(2)],
            }
        );
        assert!(
            matches!(&v[1].finding, Finding::NonAttachedDevices { pid: Pid(12), devices, .. } if devices.len() == 2)
        );
    }

    #[test]
    fn env_with_no_devices_has_all_its_processes_named() {
        let snap = HostSnapshot {
            processes: vec![proc_(10, Some("a"), &[(0, mib(1))])],
            envs: vec![env("a", None, None)],
            devices: devices(1, &[]),
            truth: None,
        };
        assert_eq!(evaluate(&HostId("h".into()), &snap).len(), 1);
    }
}
