//! Since when each job stands on each device, for the group caps' order
//! (who came last).
//!
//! A job stands on a device from when it came there, as far as the
//! enforcer has seen: from its start where it was there when first seen
//! (the host's first cycle, or a job started since the last one), from
//! the host's previous cycle where it came later (a process started long
//! ago that opens a GPU now, or one that left a device and came back, is
//! no older work there). A job on a device its environment is not
//! attached to (out of line: env-devices ends it) stands there from when
//! it came while it stays out, and from the cycle it was brought (back)
//! into line after: a job its owner brings into line takes no place
//! before work that was in line all along (seed 173 of
//! [`crate::noninterference`]'s sequences: bob attached his environment
//! where his job ran, and alice's, as old, was taken in its place). A job
//! outside genv by its own environ (no id, or one it hides) is likewise
//! in line only from when it first carries an id. While a job stays in
//! line, nothing else done to the records (its environment made
//! contested, the state garbled) moves it.
//!
//! Keyed by what its owner cannot change (host, pid and its start time in
//! the kernel's ticks, device), taken from every job the host lists,
//! whatever it carries, and bounded: a host forgets a job listed with
//! another start, or unlisted for [`FORGET_AFTER_MS`], and keeps what it
//! lists and at most [`MAX_JOBS`] more (the user with most going first); a
//! host no longer in the fleet is forgotten.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::max_devices::HostUsage;
use crate::model::{GpuIndex, HostId, HostSnapshot, Owner, Pid};

/// How long a job unlisted is remembered (ms): one that leaves its GPUs
/// for a while and comes back is still known for what it was.
pub const FORGET_AFTER_MS: u64 = 3_600_000;

/// The most jobs remembered per host beyond those it lists (those of the
/// user with most go first, those unlisted longest among them).
pub const MAX_JOBS: usize = 4096;

/// Where a job stands on one device, since it was first seen there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Line {
    /// Out of line (or outside genv by its own environ) now, or when last
    /// judged: it stands from when it came (ms since the Unix epoch), as
    /// if in line, until it is (back) in line.
    Out(u64),
    /// There, and in line (or outside genv's judgement), since then (ms
    /// since the Unix epoch).
    Since(u64),
}

/// One job's standing on each device it was seen on.
type Devices = SmallVec<[(GpuIndex, Line); 2]>;

/// One job: its start (ticks, where known), when its host last listed it
/// (ms), where it stands on each device, and its uid (the kernel's).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Job {
    start: Option<u64>,
    last: u64,
    devices: Devices,
    #[serde(default)]
    uid: Option<u32>,
}

/// One host: when it was last seen (ms), and its jobs by pid.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Host {
    seen: Option<u64>,
    jobs: HashMap<Pid, Job>,
}

/// Every host's jobs. Kept (`--state-db`) as a list of rows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Vec<Row>", into = "Vec<Row>")]
pub struct InLine(HashMap<HostId, Host>);

/// One host as kept: its id, when last seen, and its jobs.
type Row = (HostId, Option<u64>, Vec<(Pid, Job)>);

impl From<Vec<Row>> for InLine {
    fn from(rows: Vec<Row>) -> Self {
        let hosts = rows.into_iter().map(|(host, seen, jobs)| {
            let jobs = jobs.into_iter().collect();
            (host, Host { seen, jobs })
        });
        InLine(hosts.collect())
    }
}

impl From<InLine> for Vec<Row> {
    fn from(kept: InLine) -> Self {
        let rows =
            (kept.0.into_iter()).map(|(host, h)| (host, h.seen, h.jobs.into_iter().collect()));
        rows.collect()
    }
}

impl InLine {
    /// Takes in `host`'s cycle at `now` (`usage`, its part of the caps as
    /// `snap` gives it), then dates each job in `usage` from when it
    /// stands where it is.
    pub fn update(&mut self, host: &HostId, snap: &HostSnapshot, usage: &mut HostUsage, now: u64) {
        let h = self.0.entry(host.clone()).or_default();
        // Where a job comes to now, it came since the host's last cycle.
        let came = h.seen.replace(now).unwrap_or(0);
        // A pid listed with another start is another job; one listed with
        // its start unknown (this cycle or when first seen) is the same.
        let listed: HashMap<Pid, Option<u64>> = (snap.processes.iter())
            .map(|p| (p.pid, p.start_time))
            .collect();
        h.jobs.retain(|pid, job| match listed.get(pid) {
            Some(start) => job.start.is_none() || start.is_none() || *start == job.start,
            None => now.saturating_sub(job.last) <= FORGET_AFTER_MS,
        });
        // Out of line (by genv's state this cycle): from when it came
        // there, and from its return once back in line.
        for d in usage.users.values().flat_map(|h| h.devices.iter()) {
            for pid in &d.off {
                let job = h.jobs.entry(*pid).or_default();
                match job.devices.iter_mut().find(|(i, _)| *i == d.index) {
                    Some((_, line)) => {
                        let (Line::Out(since) | Line::Since(since)) = *line;
                        *line = Line::Out(since);
                    }
                    None => job.devices.push((d.index, Line::Out(came))),
                }
            }
        }
        // Every job listed, whatever it carries: there since it came; one
        // outside genv by its own environ (no id, or one it hides) is out
        // of line, now and until it carries one in line again (dropping
        // its id for a while, uncounted, then taking it back gains it no
        // place).
        for p in &snap.processes {
            let job = h.jobs.entry(p.pid).or_default();
            job.start = job.start.or(p.start_time);
            job.last = now;
            job.uid = job.uid.or(p.uid);
            let line = match p.owner {
                Owner::NoEnv | Owner::Hidden(_) => Line::Out(came),
                Owner::Env(_) | Owner::Unknown(_) => Line::Since(came),
            };
            for index in p.indices() {
                match job.devices.iter_mut().find(|(i, _)| *i == index) {
                    Some((_, held)) => {
                        if let (Line::Out(_), Line::Since(since)) = (line, *held) {
                            *held = Line::Out(since);
                        }
                    }
                    None => job.devices.push((index, line)),
                }
            }
        }
        for d in usage.users.values_mut().flat_map(|h| h.devices.iter_mut()) {
            for (pid, t) in d.starts.iter_mut() {
                let Some(job) = h.jobs.get_mut(pid) else {
                    continue;
                };
                let Some((_, line)) = job.devices.iter_mut().find(|(i, _)| *i == d.index) else {
                    continue;
                };
                if matches!(line, Line::Out(_)) && d.pids.contains(pid) {
                    *line = Line::Since(now);
                }
                let (Line::Out(since) | Line::Since(since)) = *line;
                *t = (*t).max(since);
            }
            if !d.starts.is_empty() {
                d.since = d.starts.iter().map(|(_, t)| *t).min();
            }
        }
        // What the host lists is kept (as many as it lists); of the rest,
        // at most MAX_JOBS, from the users with most first: one who floods
        // the host with short jobs, or keeps many listed, pushes out only
        // his own.
        let unlisted_now = h.jobs.values().filter(|job| job.last < now).count();
        if unlisted_now > MAX_JOBS {
            let mut per_uid: HashMap<Option<u32>, usize> = HashMap::new();
            for job in h.jobs.values().filter(|job| job.last < now) {
                *per_uid.entry(job.uid).or_default() += 1;
            }
            let mut unlisted: Vec<(Pid, usize, u64)> = (h.jobs.iter())
                .filter(|(_, job)| job.last < now)
                .map(|(pid, job)| (*pid, per_uid[&job.uid], job.last))
                .collect();
            unlisted.sort_by_key(|(_, many, last)| (std::cmp::Reverse(*many), *last));
            let over = unlisted_now - MAX_JOBS;
            for (pid, ..) in unlisted.into_iter().take(over) {
                h.jobs.remove(&pid);
            }
        }
    }

    /// Forgets the hosts `kept` refuses (those no longer in the fleet).
    pub fn keep_hosts(&mut self, kept: impl Fn(&HostId) -> bool) {
        self.0.retain(|host, _| kept(host));
    }

    /// How many jobs it knows of, over every host.
    pub fn len(&self) -> usize {
        self.0.values().map(|h| h.jobs.len()).sum()
    }

    /// Whether it knows of no job.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

    /// The host's cycle at `now` with `snap` as its snapshot and nothing
    /// of bob's counted: what the enforcer saw, nothing dated.
    fn seen_only(seen: &mut InLine, snap: &HostSnapshot, now: u64) {
        seen.update(&HostId("h".into()), snap, &mut HostUsage::default(), now);
    }

    #[test]
    fn a_job_brought_into_line_stands_from_then_for_life() {
        let mut seen = InLine::default();
        let out = bobs(&[(0, "b")]);
        // Out of line: from its start, as it came.
        let start = (vec![(Pid(20), 1020)], Some(1020));
        assert_eq!(cycle(&mut seen, &out, 10_000), start);
        assert_eq!(cycle(&mut seen, &out, 20_000), start);
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        let now = (vec![(Pid(20), 30_000)], Some(30_000));
        assert_eq!(cycle(&mut seen, &fixed, 30_000), now);
        assert_eq!(cycle(&mut seen, &fixed, 40_000), now, "not moved on");
        // Out of line again: from its time in line while out, and from
        // its return once back.
        assert_eq!(cycle(&mut seen, &out, 50_000).0, [(Pid(20), 30_000)]);
        assert_eq!(cycle(&mut seen, &fixed, 60_000).1, Some(60_000));
        assert_eq!(cycle(&mut seen, &fixed, 70_000).1, Some(60_000));
        assert_eq!(seen.len(), 1);
    }

    /// Review of c78b454, finding 2: a job first seen in line keeps its
    /// start while it stays in line (its records garbled, contested); its
    /// owner detaching and re-attaching its device makes it no older work
    /// there than what came meanwhile.
    #[test]
    fn a_job_first_seen_in_line_keeps_its_start_while_in_line_and_from_a_return_after() {
        let mut seen = InLine::default();
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        let start = (vec![(Pid(20), 1020)], Some(1020));
        assert_eq!(cycle(&mut seen, &fixed, 10_000), start);
        let mut garbled = fixed.clone();
        garbled.truth.as_mut().unwrap().state_problem = Some("garbled".into());
        assert_eq!(cycle(&mut seen, &garbled, 20_000), start);
        assert_eq!(cycle(&mut seen, &fixed, 30_000), start);
        // Its attachment removed for a cycle, then put back.
        assert_eq!(
            cycle(&mut seen, &bobs(&[(0, "b")]), 40_000).0,
            [(Pid(20), 1020)]
        );
        assert_eq!(cycle(&mut seen, &fixed, 50_000).1, Some(50_000));
    }

    /// Review of c78b454, finding 1: a job outside genv by its own environ
    /// (no id) that comes to carry one in line stands from then, not from
    /// when it came to the device.
    #[test]
    fn a_job_outside_genv_that_takes_an_environment_stands_from_then() {
        let mut seen = InLine::default();
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        let mut bare = fixed.clone();
        bare.processes[0].owner = Owner::NoEnv;
        seen_only(&mut seen, &bare, 10_000);
        seen_only(&mut seen, &bare, 20_000);
        assert_eq!(cycle(&mut seen, &fixed, 30_000).1, Some(30_000));
        assert_eq!(cycle(&mut seen, &fixed, 40_000).1, Some(30_000));
        // Review of c353a83, finding 1: one known in line that drops its id
        // for a while (uncounted) and takes it back stands from then.
        seen_only(&mut seen, &bare, 50_000);
        assert_eq!(cycle(&mut seen, &fixed, 60_000).1, Some(60_000));
        // Hidden likewise; an environ unreadable (not its doing) is not.
        for (owner, since) in [
            (Owner::Hidden("huge".into()), 160_000),
            (Owner::Unknown("gone".into()), 1020),
        ] {
            let mut first = InLine::default();
            let mut job = fixed.clone();
            job.processes[0].owner = owner;
            seen_only(&mut first, &job, 150_000);
            assert_eq!(cycle(&mut first, &fixed, 160_000).1, Some(since));
        }
    }

    /// Review of a883e69, findings 1 and 2: a job first seen out of line
    /// that leaves the device for a cycle, or moves to another, comes back
    /// in line as no older work there.
    #[test]
    fn a_job_that_comes_to_a_device_later_stands_there_from_then() {
        let mut seen = InLine::default();
        cycle(&mut seen, &bobs(&[(0, "b")]), 10_000);
        // Attached, and off its GPUs for a cycle: still known.
        let mut away = bobs(&[(0, "b"), (1, "b")]);
        away.processes[0].gpus.clear();
        seen_only(&mut seen, &away, 20_000);
        let back = bobs(&[(0, "b"), (1, "b")]);
        assert_eq!(cycle(&mut seen, &back, 30_000).1, Some(30_000));
        // Another device, in line: from the cycle before it was seen there.
        let mut moved = bobs(&[(0, "b"), (1, "b")]);
        moved.processes[0].gpus = proc_(20, Some("b"), &[(0, mib(1))]).gpus;
        let mut usage = HostUsage::of(&Attribution::of(&moved, &Default::default()), false);
        seen.update(&HostId("h".into()), &moved, &mut usage, 40_000);
        let d0 = (usage.users["bob"].devices.iter()).find(|d| d.index == GpuIndex(0));
        assert_eq!(d0.unwrap().since, Some(30_000));
        // Forgotten an hour unlisted: a host's first sighting again? No:
        // the host was seen, so a job new to it came since its last cycle.
        seen_only(&mut seen, &away, 50_000);
        let mut gone = back.clone();
        gone.processes.clear();
        seen_only(&mut seen, &gone, 50_000 + FORGET_AFTER_MS);
        assert_eq!(seen.len(), 1, "an hour unlisted: kept");
        seen_only(&mut seen, &gone, 50_001 + FORGET_AFTER_MS);
        assert!(seen.is_empty());
        assert_eq!(seen.len(), 0);
        assert_eq!(
            cycle(&mut seen, &back, 60_000 + FORGET_AFTER_MS).1,
            Some(50_001 + FORGET_AFTER_MS)
        );
    }

    /// A job known in line on one device that comes out of line to
    /// another stands there from when it is brought into line.
    #[test]
    fn a_known_job_out_of_line_on_another_device_stands_there_from_its_fix() {
        let mut seen = InLine::default();
        let mut on0 = bobs(&[(0, "b")]);
        on0.processes[0].gpus = proc_(20, Some("b"), &[(0, mib(1))]).gpus;
        seen_only(&mut seen, &on0, 10_000);
        let mut both = bobs(&[(0, "b")]);
        both.processes[0].gpus = proc_(20, Some("b"), &[(0, mib(1)), (1, mib(1))]).gpus;
        assert_eq!(
            cycle(&mut seen, &both, 20_000).1,
            Some(10_000),
            "out, from when it came"
        );
        let mut fixed = bobs(&[(0, "b"), (1, "b")]);
        fixed.processes[0].gpus = both.processes[0].gpus.clone();
        assert_eq!(cycle(&mut seen, &fixed, 30_000).1, Some(30_000));
    }

    /// A process started long ago that opens a GPU now (`exec` keeps the
    /// start time) is no older work there; on a host first seen, what
    /// runs stands from its start.
    #[test]
    fn a_process_that_opens_a_gpu_late_stands_from_the_hosts_last_cycle() {
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        let mut seen = InLine::default();
        let mut idle = fixed.clone();
        idle.processes.clear();
        seen_only(&mut seen, &idle, 10_000);
        assert_eq!(cycle(&mut seen, &fixed, 20_000).1, Some(10_000));
        let mut first = InLine::default();
        assert_eq!(cycle(&mut first, &fixed, 20_000).1, Some(1020));
    }

    /// Review of a883e69, finding 4: a job listed with its start unknown
    /// keeps what is known of it; listed with another start, it is another.
    #[test]
    fn a_start_unknown_for_a_cycle_keeps_the_job_and_another_start_is_another_job() {
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        let mut seen = InLine::default();
        cycle(&mut seen, &fixed, 10_000);
        let mut unsure = fixed.clone();
        unsure.processes[0].start_time = None;
        seen_only(&mut seen, &unsure, 20_000);
        assert_eq!(cycle(&mut seen, &fixed, 30_000).1, Some(1020));
        let mut reused = fixed.clone();
        reused.processes[0].start_time = Some(25_000);
        assert_eq!(cycle(&mut seen, &reused, 40_000).1, Some(30_000));
        assert_eq!(seen.len(), 1);
    }

    #[test]
    fn a_cycle_that_cannot_judge_it_moves_nothing_and_hosts_gone_are_forgotten() {
        let mut seen = InLine::default();
        let out = bobs(&[(0, "b")]);
        cycle(&mut seen, &out, 10_000);
        // The host's state unusable: stays out of line.
        let mut garbled = bobs(&[(0, "b"), (1, "b")]);
        garbled.truth.as_mut().unwrap().state_problem = Some("garbled".into());
        assert_eq!(cycle(&mut seen, &garbled, 20_000).1, Some(1020));
        // Contested (a job of alice's carries its id): still out.
        let mut contested = bobs(&[(0, "b"), (1, "b")]);
        let mut hers = proc_(21, Some("b"), &[(0, mib(1))]);
        hers.uid = Some(1001);
        contested.processes.push(hers);
        seen_only(&mut seen, &contested, 25_000);
        assert_eq!(seen.len(), 2);
        assert!(!seen.is_empty());
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        assert_eq!(cycle(&mut seen, &fixed, 30_000).1, Some(30_000));
        seen.keep_hosts(|h| &*h.0 == "h");
        assert_eq!(seen.len(), 2);
        seen.keep_hosts(|h| &*h.0 != "h");
        assert!(seen.is_empty());
    }

    /// Unlisted jobs past [`MAX_JOBS`] go, those unlisted longest first;
    /// listed ones stay.
    #[test]
    fn a_host_keeps_at_most_max_jobs() {
        let mut seen = InLine::default();
        let mut many = bobs(&[(0, "b"), (1, "b")]);
        let job = many.processes[0].clone();
        many.processes = (0..MAX_JOBS as u32 + 10)
            .map(|k| crate::model::Process {
                pid: Pid(100 + k),
                ..job.clone()
            })
            .collect();
        seen_only(&mut seen, &many, 10_000);
        assert_eq!(seen.len(), MAX_JOBS + 10, "all listed: all kept");
        let fixed = bobs(&[(0, "b"), (1, "b")]);
        seen_only(&mut seen, &fixed, 20_000);
        assert_eq!(
            seen.len(),
            MAX_JOBS + 1,
            "the one listed, and MAX_JOBS unlisted"
        );
        assert!(seen.0[&HostId("h".into())].jobs.contains_key(&Pid(20)));
    }

    /// Review of c78b454, finding 4: one who floods a host with short jobs
    /// pushes out his own records, not the others' older ones.
    #[test]
    fn a_flood_of_jobs_pushes_out_its_owners_records_first() {
        let mut seen = InLine::default();
        let mut hers = bobs(&[(0, "b"), (1, "b")]);
        hers.processes[0].uid = Some(1001);
        hers.processes[0].pid = Pid(7);
        seen_only(&mut seen, &hers, 5_000);
        // Two waves of short jobs of bob's, over MAX_JOBS in all.
        let mut many = bobs(&[(0, "b"), (1, "b")]);
        let job = many.processes[0].clone();
        let wave = MAX_JOBS as u32 / 2 + 10;
        for (k, now) in [(0, 10_000), (1, 15_000)] {
            many.processes = (0..wave)
                .map(|j| crate::model::Process {
                    pid: Pid(100 + k * wave + j),
                    ..job.clone()
                })
                .collect();
            seen_only(&mut seen, &many, now);
        }
        let mut none = many.clone();
        none.processes.clear();
        seen_only(&mut seen, &none, 20_000);
        let jobs = &seen.0[&HostId("h".into())].jobs;
        assert_eq!(jobs.len(), MAX_JOBS);
        assert!(jobs.contains_key(&Pid(7)), "hers, unlisted longest, kept");
        // Review of c353a83, finding 3: a flood kept listed pushes out
        // none of hers.
        let mut seen = InLine::default();
        seen_only(&mut seen, &hers, 5_000);
        many.processes = (0..MAX_JOBS as u32 + 10)
            .map(|j| crate::model::Process {
                pid: Pid(100 + j),
                ..job.clone()
            })
            .collect();
        seen_only(&mut seen, &many, 10_000);
        seen_only(&mut seen, &many, 15_000);
        assert!(seen.0[&HostId("h".into())].jobs.contains_key(&Pid(7)));
    }

    /// Users are ranked by their unlisted records alone, and a listed job
    /// is never pushed out: alice running many jobs, with a few gone,
    /// loses none of those to bob's flood of gone ones.
    #[test]
    fn only_unlisted_records_count_and_go() {
        let base = bobs(&[(0, "b"), (1, "b")]);
        let job = |pid: u32, uid: u32| crate::model::Process {
            pid: Pid(pid),
            uid: Some(uid),
            ..base.processes[0].clone()
        };
        let mut seen = InLine::default();
        let mut snap = base.clone();
        // alice's 5 jobs that end, bob's MAX_JOBS - 4 that end.
        snap.processes = (1..=5).map(|p| job(p, 1001)).collect();
        snap.processes
            .extend((0..MAX_JOBS as u32 - 4).map(|k| job(100_000 + k, 1002)));
        seen_only(&mut seen, &snap, 10_000);
        // Then alice runs MAX_JOBS jobs, carol one: MAX_JOBS + 1 unlisted.
        snap.processes = (0..MAX_JOBS as u32)
            .map(|k| job(200_000 + k, 1001))
            .collect();
        snap.processes.push(job(300_000, 1003));
        seen_only(&mut seen, &snap, 20_000);
        let jobs = &seen.0[&HostId("h".into())].jobs;
        assert!((1..=5).all(|p| jobs.contains_key(&Pid(p))), "hers kept");
        assert!(jobs.contains_key(&Pid(300_000)), "carol's listed job kept");
        let bobs_left = (0..MAX_JOBS as u32 - 4)
            .filter(|k| jobs.contains_key(&Pid(100_000 + k)))
            .count();
        assert_eq!(bobs_left, MAX_JOBS - 5, "one of bob's went");
    }
}
