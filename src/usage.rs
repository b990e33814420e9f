//! Who uses what, per host and user, from one cycle's snapshots: the
//! samples `--state-db` keeps for `report` and the per-user gauges. Pure.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::model::{Cluster, HostId};

/// One user's use of one host at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sample {
    pub host: HostId,
    pub user: String,
    /// GPUs their processes run on.
    pub devices: u32,
    /// GPU memory their processes hold (what nvidia-smi could measure).
    pub memory_bytes: u64,
    /// Their GPU processes.
    pub processes: u32,
}

/// The samples of `cluster`: per host, per user whose GPU processes run
/// there (a process whose user the host could not tell is left out), in
/// host then user order.
pub fn samples(cluster: &Cluster) -> Vec<Sample> {
    let mut out = Vec::new();
    for (host, snap) in &cluster.hosts {
        let mut by_user: BTreeMap<&str, (BTreeSet<u32>, u64, u32)> = BTreeMap::new();
        for p in &snap.processes {
            let Some(user) = p.user.as_deref() else {
                continue;
            };
            let entry = by_user.entry(user).or_default();
            entry.2 += 1;
            for g in &p.gpus {
                entry.0.insert(g.index.0);
                entry.1 += g.usage.bytes().unwrap_or(0);
            }
        }
        out.extend(
            by_user
                .into_iter()
                .map(|(user, (devices, memory_bytes, processes))| Sample {
                    host: host.clone(),
                    user: user.to_string(),
                    devices: u32::try_from(devices.len()).unwrap_or(u32::MAX),
                    memory_bytes,
                    processes,
                }),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{HostSnapshot, Mode, Usage};
    use crate::rules::test_support::{mib, proc_};

    #[test]
    fn each_users_devices_memory_and_processes_per_host() {
        let mut bobs = proc_(3, None, &[(1, mib(50))]);
        bobs.user = Some("bob".into());
        let mut nobody = proc_(4, None, &[(2, mib(1))]);
        nobody.user = None;
        let snap = HostSnapshot {
            processes: vec![
                proc_(1, Some("a"), &[(0, mib(100)), (1, mib(10))]),
                proc_(2, Some("a"), &[(0, Usage::Unknown)]),
                bobs,
                nobody,
            ],
            ..HostSnapshot::default()
        };
        let cluster = Cluster {
            mode: Mode::Remote,
            hosts: vec![(HostId("h".into()), snap)],
        };
        let s = samples(&cluster);
        let rows: Vec<(&str, u32, u64, u32)> = s
            .iter()
            .map(|s| {
                (
                    s.user.as_str(),
                    s.devices,
                    s.memory_bytes >> 20,
                    s.processes,
                )
            })
            .collect();
        assert_eq!(rows, [("alice", 2, 110, 2), ("bob", 1, 50, 1)]);
    }
}
