//! max-devices-per-group: a Unix group's quota of devices, counted over
//! every host seen this cycle (a lab's share of the fleet).
//!
//! A group's count is the sum of its members' counts, each as the per-user
//! cap counts it ([`super::max_devices`]), membership as each host
//! resolves it (the host's name service, for the users it names: the
//! owners of live processes; a recording's `groups`). A user the host
//! does not name counts toward no group. The excess is detached as the
//! per-user caps detach: devices none of the user's processes runs on
//! first (records that list no live pid of theirs before the others), then
//! those their processes run on; within each, hosts as given, devices by
//! index, users by name. Devices the per-user caps (or an earlier group,
//! groups by name) detach this cycle count as detached already.

use std::collections::{BTreeMap, HashSet};

use super::max_devices::{HeldDevice, HostUsage};
use super::{Action, Finding, Notice, Policy, Rule, Violation};
use crate::model::{EnvId, GpuIndex, HostId, HostSnapshot};

/// One host's word on its users' groups: the capped groups each user
/// counted there is a member of.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostGroups {
    pub users: BTreeMap<String, Vec<String>>,
}

impl HostGroups {
    /// The capped groups of each user in `usage`, as `snap`'s host says.
    pub fn of(snap: &HostSnapshot, usage: &HostUsage, policy: &Policy) -> Self {
        let users = usage
            .users
            .keys()
            .filter_map(|user| {
                let groups: Vec<String> = snap
                    .groups_of_user(user)
                    .into_iter()
                    .filter(|g| policy.max_devices_per_group.contains_key(*g))
                    .map(String::from)
                    .collect();
                (!groups.is_empty()).then(|| (user.clone(), groups))
            })
            .collect();
        HostGroups { users }
    }
}

/// A detached (host, device, environment).
pub type Detached = HashSet<(HostId, GpuIndex, EnvId)>;

/// What `violations` detach.
pub fn detached(violations: &[Violation]) -> Detached {
    violations
        .iter()
        .flat_map(|v| &v.actions)
        .flat_map(|a| match a {
            Action::Detach {
                host, device, eids, ..
            } => eids
                .iter()
                .map(|e| (host.clone(), *device, e.clone()))
                .collect(),
            Action::Terminate { .. } => Vec::new(),
        })
        .collect()
}

/// The group caps over every host's part (in the order given): a
/// violation per group over its cap, with the detaches that bring it down,
/// and a notice for each group whose excess cannot all be detached.
/// `detached`: what the per-user caps detach.
pub fn evaluate(
    hosts: &[(&HostId, &HostUsage, &HostGroups)],
    policy: &Policy,
    mut detached: Detached,
) -> (Vec<Violation>, Vec<Notice>) {
    let mut violations = Vec::new();
    let mut notices = Vec::new();
    for (group, &cap) in &policy.max_devices_per_group {
        // (host order, user, device) for each member's device still held.
        let mut held: Vec<(usize, &HostId, &str, &HeldDevice)> = Vec::new();
        for (k, (host, usage, groups)) in hosts.iter().enumerate() {
            for (user, devices) in &usage.users {
                if !groups.users.get(user).is_some_and(|g| g.contains(group)) {
                    continue;
                }
                held.extend(
                    devices
                        .devices
                        .iter()
                        .filter(|d| {
                            d.eids.is_empty()
                                || !d.eids.iter().all(|e| {
                                    detached.contains(&((*host).clone(), d.index, e.clone()))
                                })
                        })
                        .map(|d| (k, *host, user.as_str(), d)),
                );
            }
        }
        let count = held.len();
        let over = count.saturating_sub(cap as usize);
        if over == 0 {
            continue;
        }
        let tier = |d: &HeldDevice| match (d.working, d.vouched) {
            (false, false) => 0,
            (false, true) => 1,
            (true, _) => 2,
        };
        held.retain(|(_, _, _, d)| !d.eids.is_empty() && !d.stray);
        held.sort_by(|a, b| {
            (tier(a.3), a.0, a.3.index, a.2).cmp(&(tier(b.3), b.0, b.3.index, b.2))
        });
        let actions: Vec<Action> = held
            .into_iter()
            .take(over)
            .map(|(_, host, user, d)| {
                for e in &d.eids {
                    detached.insert((host.clone(), d.index, e.clone()));
                }
                Action::Detach {
                    host: host.clone(),
                    device: d.index,
                    eids: d.eids.clone(),
                    pids: d.pids.clone(),
                    user: user.to_string(),
                }
            })
            .collect();
        if actions.len() < over {
            notices.push(Notice::GroupExcessKept {
                group: group.clone(),
                left: over - actions.len(),
            });
        }
        violations.push(Violation {
            rule: Rule::MaxDevicesPerGroup,
            finding: Finding::MaxGroupDevices {
                group: group.clone(),
                devices: count,
                cap,
                over,
            },
            actions,
        });
    }
    (violations, notices)
}
