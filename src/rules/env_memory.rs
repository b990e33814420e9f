//! env-memory: environments over their `gpu_memory` on a device.
//!
//! genv's greedy choice: the environment's member processes on that
//! device in snapshot order until the freed usage covers the excess. Only
//! members count and are chosen: another user's process carrying the
//! environment's id neither uses up its memory nor gets its owner's jobs
//! picked. A process whose usage nvidia-smi could not measure counts for
//! nothing and is never chosen (genv 1.4.3 crashes on it instead).

use super::attribution::Attribution;
use super::{Action, Finding, Rule, Violation};
use crate::model::HostId;

pub(super) fn evaluate(host: &HostId, a: &Attribution) -> Vec<Violation> {
    let snap = a.snapshot();
    let mut out = Vec::new();
    for (i, env) in snap.envs.iter().enumerate() {
        let Some(capacity) = &env.gpu_memory else {
            continue;
        };
        for &device in a.attached(i) {
            let procs: Vec<_> = a
                .members_on(i, device)
                .filter_map(|p| p.usage_on(device).map(|u| (p.pid, u.bytes())))
                .collect();
            // Saturating: absurd usages must still read as over, never wrap to under.
            let used = procs
                .iter()
                .filter_map(|(_, b)| *b)
                .fold(0u64, u64::saturating_add);
            let Some(over) = used.checked_sub(capacity.bytes).filter(|o| *o > 0) else {
                continue;
            };
            let mut freed = 0u64;
            let mut actions = Vec::new();
            for (pid, bytes) in procs {
                let Some(bytes) = bytes else { continue };
                actions.push(Action::Terminate {
                    host: host.clone(),
                    pid,
                });
                freed = freed.saturating_add(bytes);
                if freed >= over {
                    break;
                }
            }
            out.push(Violation {
                rule: Rule::EnvMemory,
                finding: Finding::EnvMemory {
                    host: host.clone(),
                    eid: env.eid.clone(),
                    device,
                    used,
                    over,
                    capacity: capacity.text.clone(),
                },
                actions: actions.into(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{HostSnapshot, Pid, Usage};

    fn terminated(v: &Violation) -> Vec<u32> {
        v.actions
            .iter()
            .map(|a| match a {
                Action::Terminate { pid: Pid(p), .. } => *p,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    fn snap(cap: &str, procs: Vec<crate::model::Process>) -> HostSnapshot {
        HostSnapshot {
            processes: procs,
            envs: vec![env("a", Some("alice"), Some(cap))].into(),
            devices: devices(2, &[(0, "a")]).into(),
            truth: None,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_in_snapshot_order_until_excess_covered() {
        // 3 x 1000mi on device 0 with a 1500mi cap: 1500mi over, two processes go.
        let s = snap(
            "1500mi",
            vec![
                proc_(1, Some("a"), &[(0, mib(1000))]),
                proc_(2, Some("a"), &[(0, mib(1000))]),
                proc_(3, Some("a"), &[(0, mib(1000))]),
            ],
        );
        let v = evaluate(
            &HostId("h".into()),
            &Attribution::of(&s, &Default::default()),
        );
        assert_eq!(v.len(), 1);
        assert_eq!(terminated(&v[0]), vec![1, 2]);
        assert_eq!(
            v[0].finding,
            Finding::EnvMemory {
                host: HostId("h".into()),
                eid: crate::model::EnvId("a".into()),
                device: crate::model::GpuIndex(0),
                used: 3000 * 1024 * 1024,
                over: 1500 * 1024 * 1024,
                capacity: "1500mi".into(),
            }
        );
    }

    #[test]
    fn at_capacity_is_compliant_and_unattached_devices_are_not_summed() {
        let s = snap(
            "2000mi",
            vec![proc_(1, Some("a"), &[(0, mib(2000)), (1, mib(5000))])],
        );
        assert!(evaluate(
            &HostId("h".into()),
            &Attribution::of(&s, &Default::default())
        )
        .is_empty());
    }

    #[test]
    fn zero_capacity_terminates_every_measured_process() {
        let s = snap(
            "0",
            vec![
                proc_(1, Some("a"), &[(0, mib(1))]),
                proc_(2, Some("a"), &[(0, mib(1))]),
            ],
        );
        let v = evaluate(
            &HostId("h".into()),
            &Attribution::of(&s, &Default::default()),
        );
        assert_eq!(terminated(&v[0]), vec![1, 2]);
    }

    #[test]
    fn unknown_usage_is_never_terminated_and_frees_nothing() {
        let s = snap(
            "1000mi",
            vec![
                proc_(1, Some("a"), &[(0, Usage::Unknown)]),
                proc_(2, Some("a"), &[(0, mib(800))]),
                proc_(3, Some("a"), &[(0, mib(800))]),
            ],
        );
        let v = evaluate(
            &HostId("h".into()),
            &Attribution::of(&s, &Default::default()),
        );
        assert_eq!(terminated(&v[0]), vec![2]);
        let only_unknown = snap("1mi", vec![proc_(1, Some("a"), &[(0, Usage::Unknown)])]);
        assert!(evaluate(
            &HostId("h".into()),
            &Attribution::of(&only_unknown, &Default::default())
        )
        .is_empty());
    }

    #[test]
    fn sums_saturate_instead_of_wrapping() {
        // Two 8796093022208mi usages wrap a u64 to 0: still a violation.
        let huge = Usage::Known(8_796_093_022_208 * 1024 * 1024);
        let s = snap(
            "1gi",
            vec![
                proc_(1, Some("a"), &[(0, huge)]),
                proc_(2, Some("a"), &[(0, huge)]),
            ],
        );
        let v = evaluate(
            &HostId("h".into()),
            &Attribution::of(&s, &Default::default()),
        );
        assert_eq!(v.len(), 1);
        assert!(matches!(
            v[0].finding,
            Finding::EnvMemory { used: u64::MAX, .. }
        ));
        assert_eq!(terminated(&v[0]), vec![1, 2]);
    }

    #[test]
    fn env_without_gpu_memory_is_unlimited() {
        let s = HostSnapshot {
            processes: vec![proc_(1, Some("a"), &[(0, mib(80000))])],
            envs: vec![env("a", None, None)].into(),
            devices: devices(1, &[(0, "a")]).into(),
            truth: None,
            ..Default::default()
        };
        assert!(evaluate(
            &HostId("h".into()),
            &Attribution::of(&s, &Default::default())
        )
        .is_empty());
    }
}
