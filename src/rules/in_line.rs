//! Since when each job is in line on each device, for the group caps'
//! order (who came last).
//!
//! A job first seen on a device its environment is not attached to (out
//! of line: env-devices ends it) that is then brought into line there
//! (the environment attached) stands, on that device, as if started when
//! it came into line: a stray its owner brings into line takes no place
//! before work that was in line all along (seed 173 of
//! [`crate::noninterference`]'s sequences: bob attached his environment
//! where his stray ran, and alice's job, as old, was taken in its place).
//! A job first seen in line keeps its start time for life, whatever is
//! done to the records later: an attachment of hers removed for a cycle
//! and put back (which anyone can do) moves nothing. Only what genv's
//! state says of a member counts: a job whose environment is contested,
//! gone or cannot be judged this cycle (its host's state unusable) is
//! neither, and leaves what is known of it as it was.
//!
//! Keyed by what its owner cannot change (host, pid, start time, device)
//! and bounded by the live jobs: a host seen forgets the jobs it no
//! longer runs; one unseen keeps what it had.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::max_devices::HostUsage;
use crate::model::{GpuIndex, HostId, HostSnapshot, Pid};

/// Where a job stands on one device, since it was first seen there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Line {
    /// In line when first seen: its start time stands.
    Always,
    /// Out of line when first seen, and since.
    Out,
    /// Out of line when first seen, in line since then (ms since the Unix
    /// epoch, a cycle's time).
    Since(u64),
}

/// One job's standing on each device it was seen on.
type Devices = SmallVec<[(GpuIndex, Line); 2]>;

/// Every host's jobs, by pid and start time (ms since the Unix epoch).
/// Kept (`--state-db`) as a list of rows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Vec<Row>", into = "Vec<Row>")]
pub struct InLine(HashMap<HostId, HashMap<(Pid, u64), Devices>>);

/// One job on one device: host, pid, start time, device, standing.
type Row = (HostId, Pid, u64, GpuIndex, Line);

impl From<Vec<Row>> for InLine {
    fn from(rows: Vec<Row>) -> Self {
        let mut kept = InLine::default();
        for (host, pid, start, device, line) in rows {
            let job = kept.0.entry(host).or_default().entry((pid, start));
            job.or_default().push((device, line));
        }
        kept
    }
}

impl From<InLine> for Vec<Row> {
    fn from(kept: InLine) -> Self {
        let mut rows = Vec::new();
        for (host, jobs) in kept.0 {
            for ((pid, start), devices) in jobs {
                for (device, line) in devices {
                    rows.push((host.clone(), pid, start, device, line));
                }
            }
        }
        rows
    }
}

impl InLine {
    /// Takes in `host`'s cycle at `now` (`usage`, its part of the caps as
    /// `snap` gives it), then dates in `usage` each job brought into line
    /// from when it was.
    pub fn update(&mut self, host: &HostId, snap: &HostSnapshot, usage: &mut HostUsage, now: u64) {
        let jobs = self.0.entry(host.clone()).or_default();
        let live: std::collections::HashSet<(Pid, u64)> = (snap.processes.iter())
            .filter_map(|p| Some((p.pid, snap.started(p)?)))
            .collect();
        jobs.retain(|key, _| live.contains(key));
        for d in usage.users.values_mut().flat_map(|h| h.devices.iter_mut()) {
            for (pid, t) in d.starts.iter_mut() {
                let in_line = d.pids.contains(pid);
                if !in_line && !d.off.contains(pid) {
                    continue;
                }
                let seen = jobs.entry((*pid, *t)).or_default();
                let line = match seen.iter_mut().find(|(i, _)| *i == d.index) {
                    Some((_, line)) => line,
                    None => {
                        let first = if in_line { Line::Always } else { Line::Out };
                        seen.push((d.index, first));
                        &mut seen.last_mut().expect("just pushed").1
                    }
                };
                if in_line && *line == Line::Out {
                    *line = Line::Since(now);
                }
                if let (true, Line::Since(since)) = (in_line, *line) {
                    *t = (*t).max(since);
                }
            }
            if !d.starts.is_empty() {
                d.since = d.starts.iter().map(|(_, t)| *t).min();
            }
        }
        if jobs.is_empty() {
            self.0.remove(host);
        }
    }

    /// How many jobs it knows of, over every host.
    pub fn len(&self) -> usize {
        self.0.values().map(HashMap::len).sum()
    }

    /// Whether it knows of none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{Boot, HostTruth};
    use crate::rules::attribution::Attribution;

    /// bob's environment `b` attached as `attached` says, his job of it
    /// (pid 20, started at 1020 on a recording's clock) on device 1.
    fn bobs(attached: &[(u32, &str)]) -> HostSnapshot {
        let mut job = proc_(20, Some("b"), &[(1, mib(1))]);
        job.uid = Some(1002);
        HostSnapshot {
            processes: vec![job],
            envs: vec![env("b", Some("bob"), None)].into(),
            devices: devices(2, attached).into(),
            truth: Some(HostTruth {
                // A tick a millisecond from the epoch: started at 1020 ms.
                boot: Some(Boot { btime: 0, hz: 1000 }),
                ..alice_and_bob(&[])
            }),
            ..Default::default()
        }
    }

    /// Its cycle at `now`: bob's job's start on device 1, and the device's.
    fn cycle(seen: &mut InLine, snap: &HostSnapshot, now: u64) -> (Vec<(Pid, u64)>, Option<u64>) {
        let mut usage = HostUsage::of(&Attribution::of(snap, &Default::default()), false);
        seen.update(&HostId("h".into()), snap, &mut usage, now);
        let d = (usage.users["bob"].devices.iter())
            .find(|d| d.index == GpuIndex(1))
            .expect("device 1 held");
        (d.starts.to_vec(), d.since)
    }

    #[test]
    fn a_job_brought_into_line_stands_from_then_for_life() {
        let mut seen = InLine::default();
        let out = bobs(&[(0, "b")]);
        assert_eq!(
            cycle(&mut seen, &out, 10_000),
            (vec![(Pid(20), 1020)], Some(1020))
        );
        assert_eq!(
            cycle(&mut seen, &out, 20_000),
            (vec![(Pid(20), 1020)], Some(1020))
        );
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        let now = (vec![(Pid(20), 30_000)], Some(30_000));
        assert_eq!(cycle(&mut seen, &fixed, 30_000), now);
        assert_eq!(cycle(&mut seen, &fixed, 40_000), now, "not moved on");
        // Out of line again and back: still from its first time in line.
        assert_eq!(cycle(&mut seen, &out, 50_000).0, [(Pid(20), 1020)]);
        assert_eq!(cycle(&mut seen, &fixed, 60_000), now);
        assert_eq!(seen.len(), 1);
    }

    #[test]
    fn a_job_first_seen_in_line_keeps_its_start_whatever_its_records_do() {
        let mut seen = InLine::default();
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        let start = (vec![(Pid(20), 1020)], Some(1020));
        assert_eq!(cycle(&mut seen, &fixed, 10_000), start);
        // Its attachment removed for a cycle, then put back.
        assert_eq!(cycle(&mut seen, &bobs(&[(0, "b")]), 20_000), start);
        assert_eq!(cycle(&mut seen, &fixed, 30_000), start);
    }

    #[test]
    fn a_cycle_that_cannot_judge_it_changes_nothing_and_a_gone_job_is_forgotten() {
        let mut seen = InLine::default();
        let out = bobs(&[(0, "b")]);
        cycle(&mut seen, &out, 10_000);
        // The host's state unusable: nothing said of the job, kept.
        let mut garbled = bobs(&[(0, "b"), (1, "b")]);
        garbled.truth.as_mut().unwrap().state_problem = Some("garbled".into());
        cycle(&mut seen, &garbled, 20_000);
        assert_eq!(seen.len(), 1);
        // Contested (a job of alice's carries its id): neither, kept.
        let mut contested = bobs(&[(0, "b"), (1, "b")]);
        let mut hers = proc_(21, Some("b"), &[(0, mib(1))]);
        hers.uid = Some(1001);
        contested.processes.push(hers);
        cycle(&mut seen, &contested, 25_000);
        assert!(!seen.is_empty());
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        assert_eq!(cycle(&mut seen, &fixed, 30_000).1, Some(30_000));
        // Gone: forgotten, and the host with it.
        let mut gone = fixed.clone();
        gone.processes.clear();
        let mut usage = HostUsage::default();
        seen.update(&HostId("h".into()), &gone, &mut usage, 40_000);
        assert!(seen.is_empty());
        assert_eq!(seen.len(), 0);
    }
}
