//! max-devices-per-user: caps on the devices a user's environments are
//! attached to, counted over every host seen this cycle.
//!
//! A user's count is the number of (host, device) pairs any of the
//! environments charged to them is attached to (see [`super::attribution`]:
//! the host's truth, not the record, says whose an environment is). The
//! excess is detached in genv's order: hosts as given, devices by index,
//! each chosen device detached from all of that user's environments on it.
//! Users are visited in name order (genv: Python set order).

use std::collections::BTreeMap;

use super::attribution::Charge;
use super::{Action, Finding, Policy, Rule, Violation};
use crate::model::{Cluster, EnvId, GpuIndex, HostId, HostSnapshot};

/// One host where a user has environments, and those environments.
type UserOnHost<'a> = (&'a HostId, &'a HostSnapshot, Vec<&'a EnvId>);

/// `charges`: whose cap each environment of each host counts toward
/// ([`super::Charges`]).
pub(super) fn evaluate(
    cluster: &Cluster,
    policy: &Policy,
    charges: &[Vec<Charge>],
) -> Vec<Violation> {
    // user -> hosts in order, each with the user's environments there.
    let mut users: BTreeMap<&str, Vec<UserOnHost>> = BTreeMap::new();
    for ((host, snap), charges) in cluster.hosts.iter().zip(charges) {
        for (env, charge) in snap.envs.iter().zip(charges) {
            let Charge::User(user) = charge else {
                continue;
            };
            let hosts = users.entry(user).or_default();
            match hosts.last_mut() {
                Some((h, _, eids)) if *h == host => eids.push(&env.eid),
                _ => hosts.push((host, snap, vec![&env.eid])),
            }
        }
    }
    let mut out = Vec::new();
    for (user, hosts) in users {
        let Some(cap) = policy.cap_for(user) else {
            continue;
        };
        // (host, device, the user's eids attached there), in genv's order.
        let mut attached: Vec<(&HostId, GpuIndex, Vec<EnvId>)> = Vec::new();
        for (host, snap, eids) in &hosts {
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
                hosts: hosts.len(),
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
            truth: None,
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
        let v = crate::rules::evaluate(&c, &policy(Some(1), &[]));
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
        let v = crate::rules::evaluate(&c, &policy(Some(2), &[]));
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
        let v = crate::rules::evaluate(&c, &policy(Some(1), &[("alice", 0)]));
        assert_eq!(v.len(), 1);
        assert!(
            matches!(&v[0].finding, Finding::MaxDevices { user, over: 1, .. } if user == "alice")
        );
        // Per-user caps apply without a global cap; other users are uncapped.
        let v = crate::rules::evaluate(&c, &policy(None, &[("bob", 0)]));
        assert!(matches!(&v[0].finding, Finding::MaxDevices { user, .. } if user == "bob"));
        assert!(crate::rules::evaluate(&c, &policy(None, &[])).is_empty());
        assert!(
            crate::rules::evaluate(&c, &policy(Some(0), &[("alice", 5), ("bob", 5)])).is_empty()
        );
    }
}
