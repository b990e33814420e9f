//! max-devices-per-user: caps on the devices a user's environments are
//! attached to, counted over every host seen this cycle.
//!
//! A user's count is the number of (host, device) pairs any of their
//! environments is attached to. The excess is detached in genv's order:
//! hosts as given, devices by index, each chosen device detached from all
//! of that user's environments on it. Users are visited in name order
//! (genv: Python set order). Environments without a username never count.

use std::collections::BTreeSet;

use super::{Action, Finding, Policy, Rule, Violation};
use crate::model::{Cluster, EnvId};

pub(super) fn evaluate(cluster: &Cluster, policy: &Policy) -> Vec<Violation> {
    let users: BTreeSet<&str> = cluster
        .hosts
        .iter()
        .flat_map(|(_, s)| &s.envs)
        .filter_map(|e| e.username.as_deref())
        .filter(|u| !u.is_empty())
        .collect();
    let mut out = Vec::new();
    for user in users {
        let Some(cap) = policy.cap_for(user) else {
            continue;
        };
        // (host, device, the user's eids attached there), in genv's order.
        let mut attached = Vec::new();
        let mut hosts = 0;
        for (host, snap) in &cluster.hosts {
            let eids: Vec<&EnvId> = snap
                .envs
                .iter()
                .filter(|e| e.username.as_deref() == Some(user))
                .map(|e| &e.eid)
                .collect();
            if !eids.is_empty() {
                hosts += 1;
            }
            for device in &snap.devices {
                let mine: Vec<EnvId> = device
                    .attachments
                    .iter()
                    .filter(|a| eids.contains(&&a.eid))
                    .map(|a| a.eid.clone())
                    .collect();
                if !mine.is_empty() {
                    attached.push((host, device.index, mine));
                }
            }
        }
        let over = attached.len().saturating_sub(cap as usize);
        if over == 0 {
            continue;
        }
        out.push(Violation {
            rule: Rule::MaxDevicesPerUser,
            finding: Finding::MaxDevices {
                user: user.to_string(),
                devices: attached.len(),
                hosts,
                over,
            },
            actions: attached
                .into_iter()
                .take(over)
                .map(|(host, device, eids)| Action::Detach {
                    host: host.clone(),
                    device,
                    eids,
                })
                .collect(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{GpuIndex, HostId, HostSnapshot, Mode};

    fn policy(global: Option<u32>, per_user: &[(&str, u32)]) -> Policy {
        Policy {
            max_devices_per_user: global,
            max_devices_for_user: per_user.iter().map(|(u, n)| (u.to_string(), *n)).collect(),
            ..Policy::default()
        }
    }

    fn host(envs: Vec<crate::model::Env>, attachments: &[(u32, &str)]) -> HostSnapshot {
        HostSnapshot {
            processes: vec![],
            envs,
            devices: devices(4, attachments),
        }
    }

    fn detached(v: &Violation) -> Vec<(String, u32, usize)> {
        v.actions
            .iter()
            .map(|a| match a {
                Action::Detach { host, device, eids } => (host.0.clone(), device.0, eids.len()),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn over_cap_by_several_detaches_first_devices_in_order() {
        let c = local(host(
            vec![
                env("a1", Some("alice"), None),
                env("a2", Some("alice"), None),
                env("b", Some("bob"), None),
            ],
            &[(0, "a1"), (1, "a1"), (1, "a2"), (2, "a2"), (3, "b")],
        ));
        let v = evaluate(&c, &policy(Some(1), &[]));
        assert_eq!(v.len(), 1);
        assert_eq!(
            v[0].finding,
            Finding::MaxDevices {
                user: "alice".into(),
                devices: 3,
                hosts: 1,
                over: 2
            }
        );
        assert_eq!(
            detached(&v[0]),
            vec![("localhost".into(), 0, 1), ("localhost".into(), 1, 2)]
        );
    }

    #[test]
    fn across_hosts_in_given_order() {
        let h1 = host(vec![env("a", Some("alice"), None)], &[(2, "a"), (3, "a")]);
        let h2 = host(vec![env("x", Some("alice"), None)], &[(0, "x")]);
        let c = Cluster {
            mode: Mode::Remote,
            hosts: vec![(HostId("h2".into()), h2), (HostId("h1".into()), h1)],
        };
        let v = evaluate(&c, &policy(Some(2), &[]));
        assert_eq!(
            v[0].finding,
            Finding::MaxDevices {
                user: "alice".into(),
                devices: 3,
                hosts: 2,
                over: 1
            }
        );
        assert_eq!(detached(&v[0]), vec![("h2".into(), 0, 1)]);
        assert!(matches!(
            &v[0].actions[0],
            Action::Detach {
                device: GpuIndex(0),
                ..
            }
        ));
    }

    #[test]
    fn overrides_zero_caps_and_nameless_envs() {
        let c = local(host(
            vec![
                env("a", Some("alice"), None),
                env("b", Some("bob"), None),
                env("n", None, None),
            ],
            &[(0, "a"), (1, "b"), (2, "n"), (3, "n")],
        ));
        // bob may have 1; alice 0 by override; the nameless env is never counted.
        let v = evaluate(&c, &policy(Some(1), &[("alice", 0)]));
        assert_eq!(v.len(), 1);
        assert!(
            matches!(&v[0].finding, Finding::MaxDevices { user, over: 1, .. } if user == "alice")
        );
        // Per-user caps apply without a global cap; other users are uncapped.
        let v = evaluate(&c, &policy(None, &[("bob", 0)]));
        assert!(matches!(&v[0].finding, Finding::MaxDevices { user, .. } if user == "bob"));
        assert!(evaluate(&c, &policy(None, &[])).is_empty());
        assert!(evaluate(&c, &policy(Some(0), &[("alice", 5), ("bob", 5)])).is_empty());
    }
}
