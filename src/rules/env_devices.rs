//! env-devices: member processes on GPUs their environment is not
//! attached to.
//!
//! genv's order: environments in snapshot order, each one's members in
//! snapshot order. An orphan (a process whose environment is gone) is no
//! member of any environment and is not named, as genv does not name a
//! process whose environment does not exist. A process whose id several
//! users' jobs carry (contested) is judged against that id's record as
//! genv judges it, whoever is charged: the record's attachments are the
//! same whoever carries the id, so a job bob starts with alice's id takes
//! none of her jobs out of this rule (nor puts his own out of it).

use super::attribution::{Attribution, Standing, Stray};
use super::{Finding, Rule, Violation};
use crate::model::{HostId, Indices};

pub(super) fn evaluate(host: &HostId, a: &Attribution) -> Vec<Violation> {
    let snap = a.snapshot();
    let mut contested: Vec<(usize, usize)> = (snap.processes.iter().enumerate())
        .filter(|(pi, _)| matches!(a.standing(*pi), Standing::Stray(Stray::Contested { .. })))
        .filter_map(|(pi, p)| Some((a.env(p.owner.eid()?)?, pi)))
        .collect();
    contested.sort_unstable();
    let mut out = Vec::new();
    let mut judged = Vec::new();
    for (i, env) in snap.envs.iter().enumerate() {
        judged.clear();
        judged.extend_from_slice(a.member_indices(i));
        let from = contested.partition_point(|(e, _)| *e < i);
        let to = contested.partition_point(|(e, _)| *e <= i);
        if from < to {
            judged.extend(contested[from..to].iter().map(|(_, pi)| *pi));
            judged.sort_unstable();
        }
        for p in judged.iter().map(|&pi| &snap.processes[pi]) {
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

    /// Bob starts a job with alice's id: her jobs are strays of a
    /// contested id, still judged against its record as genv judges them
    /// (hers on device 1, which it is not attached to, as before), and his
    /// is judged the same way.
    #[test]
    fn a_contested_ids_carriers_are_judged_against_its_record() {
        let job = |pid: u32, uid: u32, gpu: u32| {
            let mut p = proc_(pid, Some("a"), &[(gpu, mib(1))]);
            p.uid = Some(uid);
            p
        };
        let snap = HostSnapshot {
            processes: vec![
                job(10, 1001, 0),
                job(11, 1001, 1),
                job(20, 1002, 2),
                job(21, 1002, 0),
            ],
            envs: vec![env("a", Some("alice"), None)].into(),
            devices: devices(3, &[(0, "a")]).into(),
            truth: Some(alice_and_bob(&[(10, 1001)])),
            ..Default::default()
        };
        let a = Attribution::of(&snap, &Default::default());
        assert!(matches!(
            a.standing(1),
            Standing::Stray(Stray::Contested { .. })
        ));
        let named: Vec<u32> = (evaluate(&HostId("h".into()), &a).iter())
            .map(|v| match &v.finding {
                Finding::NonAttachedDevices { pid, .. } => pid.0,
                f => panic!("{f:?}"),
            })
            .collect();
        assert_eq!(named, [11, 20], "in snapshot order, whoever carries it");
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
