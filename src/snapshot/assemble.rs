//! One host snapshot from the raw parts a host gave, for local and remote
//! hosts alike: nvidia-smi's two answers, genv's state files, and what
//! `/proc` said about the pids involved (the GPU processes and the live
//! pids that environments list). Pure: gathering the parts is the host's.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use super::{genv, nvidia_smi, ParseError};
use crate::model::{Device, Env, EnvId, HostSnapshot, HostTruth, Owner, Pid, Process};

/// What a host gave for one snapshot; its texts borrowed from the host's
/// answer where they can be (a remote agent's), owned otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawHost<'a> {
    /// `nvidia-smi --query-gpu=uuid,index,memory.total --format=csv,noheader,nounits`.
    pub gpus: Cow<'a, str>,
    /// `nvidia-smi --query-compute-apps=gpu_uuid,pid,used_gpu_memory --format=csv,noheader,nounits`.
    pub apps: Cow<'a, str>,
    /// `envs.json`, `devices.json` as read (not checked to be UTF-8);
    /// `None` where absent.
    pub envs: Option<Cow<'a, [u8]>>,
    pub devices: Option<Cow<'a, [u8]>>,
    /// What `/proc` said about each pid asked about: the GPU processes and
    /// the live pids that environments list. A pid missing here was not alive.
    pub procs: BTreeMap<u32, RawProc<'a>>,
    /// The host's user names for the uids in `procs`.
    pub user_names: BTreeMap<u32, Arc<str>>,
    /// `groups <uid>`: the names of each uid's groups, when asked for.
    pub groups: BTreeMap<u32, Vec<String>>,
    /// `clock`: the host's boot time and clock ticks per second.
    pub boot: Option<crate::model::Boot>,
    /// `nvidia-smi pmon -c 1 -s u`, when asked and it succeeded.
    pub pmon: Option<Cow<'a, str>>,
    /// `--query-gpu=index,utilization.gpu --format=csv,noheader,nounits`,
    /// when asked (utilization is known only then).
    pub gpu_utilization: Option<Cow<'a, str>>,
    /// `subuid <uid>`: for a uid seen that has no name on the host, the
    /// uid of the owner of the sub-uid range holding it, or why none.
    pub sub_uids: BTreeMap<u32, Result<u32, String>>,
    /// `unnamed <uid>`: a uid whose name the agent did not look up within
    /// its deadline or lookup bound, and why: its processes are unknown
    /// (a name decides exemptions and overrides), counted, never acted on.
    pub unnamed: BTreeMap<u32, String>,
    /// `state-error <part>`: why a state file (or the directory) could
    /// not be read.
    pub state_errors: BTreeMap<String, String>,
    /// `lock`: who held genv's lock past the agent's wait.
    pub lock_held: Option<String>,
    /// `mps <pid>`: the GPU processes that run the driver's MPS server file.
    pub mps: BTreeMap<u32, RawMps>,
}

/// What the agent said of a GPU process that runs the driver's MPS server
/// file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawMps {
    /// The machine's shared server (root's control daemon started it).
    Shared,
    /// A user's own, and why it is not the shared one.
    Own(String),
}

/// What `/proc/<pid>` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawProc<'a> {
    /// The process's start time, real uid and environment, all read
    /// between two reads of the same start time.
    Seen {
        start_time: u64,
        uid: Option<u32>,
        environ: Environ<'a>,
    },
    /// Its identity could not be pinned (the start time changed between the
    /// reads: the pid was reused while we read): never acted on.
    Unsure(String),
}

/// `GENV_ENVIRONMENT_ID` in a process's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Environ<'a> {
    /// Not read: a listed pid, not a GPU process.
    NotRead,
    /// The variable's value, byte for byte (the last one, as genv reads it).
    Var(Cow<'a, [u8]>),
    /// Read, and the variable is not there.
    NoVar,
    /// Could not be read, and why.
    Unreadable(String),
    /// Not read, for a reason the process controls (see [`Owner::Hidden`]).
    ///
    /// [`Owner::Hidden`]: crate::model::Owner::Hidden
    Hidden(String),
}

/// The state files one host had last time, parsed, kept across cycles:
/// unchanged files (the usual case) are compared, not parsed again, and
/// when the pids they list are as alive as last time, their cleaned-up
/// records are shared with last cycle's snapshot, not copied.
/// The bytes are not kept: a file is known again by its length and a hash
/// keyed at random for each host ([`Seen`]), so a host's kept state costs
/// what its records do, not its file's size as well.
#[derive(Debug, Default)]
pub struct ParsedState {
    key: std::hash::RandomState,
    envs: Option<(Seen, Vec<Env>, usize)>,
    devices: Option<(Seen, Vec<Device>, usize)>,
    cleaned: Option<Cleaned>,
}

/// A file as last read: its length and its SipHash under the host's
/// random key (which no user knows, so none can write another file that
/// passes for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen(usize, u64);

/// A host's environments and devices, cleaned up and normalized, shared;
/// how many records and attachments held an overlong string.
type State = (Arc<Vec<Env>>, Arc<Vec<Device>>, usize);

/// Both files as last parsed, cleaned up and normalized, and which of the
/// pids they list (in order) were alive then.
#[derive(Debug)]
struct Cleaned {
    alive: Vec<bool>,
    envs: Arc<Vec<Env>>,
    devices: Arc<Vec<Device>>,
    garbled: usize,
}

/// `bytes` parsed by `parse` (once found to be UTF-8) and bounded by
/// `bound` (every string cut to its limit, so that none is kept whole: its
/// count of records garbled kept beside), or what `cache` holds for the
/// same bytes (as `key` hashes them); and whether it held them.
fn cached<'c, T>(
    cache: &'c mut Option<(Seen, Vec<T>, usize)>,
    key: &std::hash::RandomState,
    bytes: &[u8],
    parse: impl FnOnce(&str) -> Result<Vec<T>, ParseError>,
    bound: impl FnOnce(&mut Vec<T>) -> usize,
) -> Result<(&'c Vec<T>, usize, bool), ParseError> {
    use std::hash::BuildHasher;
    let seen = Seen(bytes.len(), key.hash_one(bytes));
    let held = cache.as_ref().is_some_and(|(s, ..)| *s == seen);
    if !held {
        let text = std::str::from_utf8(bytes)
            .map_err(|e| ParseError::new("", format!("byte {}", e.valid_up_to()), "not UTF-8"))?;
        let mut parsed = parse(text)?;
        let garbled = bound(&mut parsed);
        *cache = Some((seen, parsed, garbled));
    }
    let (_, parsed, garbled) = cache.as_ref().expect("cached above");
    Ok((parsed, *garbled, held))
}

/// Builds a host snapshot as `genv usage snapshot` would (with genv's
/// load-time clean-up), [`genv::normalize`]d, plus each process's identity
/// (its uid resolved to a sub-uid range's owner where the host said so)
/// and the host's names for their users. `source` names the host in
/// errors; `parsed` is the host's state as parsed last time.
///
/// genv's state that cannot be used (a file the agent refused, one that
/// does not parse or holds more than `max_records` records) fails nothing:
/// the snapshot holds no environments and no attachments, and says why in
/// [`HostTruth::state_problem`] (a degraded host: only what needs no genv
/// state is judged there).
///
/// # Errors
/// nvidia-smi's answers do not parse.
pub fn assemble(
    raw: &RawHost,
    source: &str,
    parsed: &mut ParsedState,
    max_records: usize,
) -> Result<HostSnapshot, ParseError> {
    // Errors name the host and the part; the names are made only then.
    let named = |what: &'static str| move |e: ParseError| e.from(&format!("{source}: {what}"));
    let gpus = nvidia_smi::parse_gpus(&raw.gpus, "").map_err(named("nvidia-smi --query-gpu"))?;
    let apps = nvidia_smi::parse_compute_apps(&raw.apps, "")
        .map_err(named("nvidia-smi --query-compute-apps"))?;
    let by_pid = nvidia_smi::processes(&gpus, &apps, "").map_err(named("nvidia-smi"))?;
    let (envs, devices, garbled, state_problem) = match genv_state(raw, parsed, max_records, &gpus)
    {
        Ok((envs, devices, garbled)) => (envs, devices, garbled, None),
        Err(problem) => (
            Arc::default(),
            Arc::new(nvidia_smi::devices(&gpus)),
            0,
            Some(problem),
        ),
    };

    let ids = Ids::of(&envs);
    let (mut processes, mut mps_servers) = (Vec::with_capacity(by_pid.len()), Vec::new());
    for (pid, gpus) in by_pid {
        let p = process(raw, pid, gpus, &ids);
        match (raw.mps.get(&pid.0), p.start_time) {
            // Only a process seen (its identity pinned) is the server.
            (Some(RawMps::Shared), Some(_)) => mps_servers.push(crate::model::MpsServer {
                pid,
                start_time: p.start_time,
                uid: p.uid,
                user: p.user,
                gpus: p.gpus,
            }),
            _ => processes.push(p),
        }
    }
    let pid_uids = envs
        .iter()
        .flat_map(|e| &e.pids)
        .filter_map(|p| {
            let uid = match raw.procs.get(&u32::try_from(*p).ok()?)? {
                RawProc::Seen { uid, .. } => (*uid)?,
                RawProc::Unsure(_) => return None,
            };
            Some((*p, charged_uid(raw, uid).0))
        })
        .collect();
    Ok(HostSnapshot {
        processes,
        envs,
        devices,
        truth: Some(HostTruth {
            pid_uids,
            user_names: raw.user_names.clone(),
            groups: raw.groups.clone(),
            boot: raw.boot,
            state_problem,
            garbled_records: garbled,
            lock_held: raw.lock_held.clone(),
            unresolved_uids: raw
                .sub_uids
                .iter()
                .filter_map(|(uid, owner)| Some((*uid, owner.as_ref().err()?.clone())))
                .collect(),
            mps_servers,
            own_mps_servers: raw
                .mps
                .iter()
                .filter_map(|(pid, role)| match role {
                    RawMps::Own(why) => Some((Pid(*pid), why.clone())),
                    RawMps::Shared => None,
                })
                .collect(),
        }),
        utilization: match &raw.gpu_utilization {
            Some(text) => Some(crate::model::Utilization {
                // pmon prints process names, which users pick: what does
                // not parse gives no process its own figure (unknown), and
                // never fails the host.
                processes: raw
                    .pmon
                    .as_deref()
                    .and_then(|t| nvidia_smi::parse_pmon(t, "").ok()),
                gpus: nvidia_smi::parse_gpu_utilization(text, "")
                    .map_err(named("nvidia-smi --query-gpu=index,utilization.gpu"))?,
            }),
            None => None,
        },
        recorded_groups: Default::default(),
    })
}

/// genv's environments and devices as the host's files hold them after
/// genv's load-time clean-up, [`genv::normalize`]d, or why they cannot be
/// used (every reason, in one line).
fn genv_state(
    raw: &RawHost,
    parsed: &mut ParsedState,
    max_records: usize,
    gpus: &[nvidia_smi::Gpu],
) -> Result<State, String> {
    // Kept only by a cycle that ends with both files parsed as before.
    let last = parsed.cleaned.take();
    if !raw.state_errors.is_empty() {
        let said: Vec<&str> = raw.state_errors.values().map(String::as_str).collect();
        return Err(said.join("; "));
    }
    let say = |what: &str, e: ParseError| e.from(what).to_string();
    let (no_envs, listed);
    let (envs, envs_garbled, envs_held) = match &raw.envs {
        Some(text) => cached(
            &mut parsed.envs,
            &parsed.key,
            text,
            |t| genv::parse_envs(t, ""),
            genv::bound_envs,
        )
        .map_err(|e| say("envs.json", e))?,
        None => {
            no_envs = Vec::new();
            (&no_envs, 0, false)
        }
    };
    let (devices, devices_garbled, devices_held) = match &raw.devices {
        Some(text) => cached(
            &mut parsed.devices,
            &parsed.key,
            text,
            |t| genv::parse_devices(t, ""),
            |d| genv::bound_devices(d),
        )
        .map_err(|e| say("devices.json", e))?,
        None => {
            listed = nvidia_smi::devices(gpus);
            (&listed, 0, false)
        }
    };
    // A file over the limit is not kept for the next cycle either: a user
    // may write one on every host.
    if let Err(e) = genv::within(
        genv::env_records(envs),
        max_records,
        "envs.json",
        "environments, their pids and kernel ids",
    ) {
        parsed.envs = None;
        return Err(e.to_string());
    }
    if let Err(e) = genv::within(
        genv::device_records(devices),
        max_records,
        "devices.json",
        "devices and attachments",
    ) {
        parsed.devices = None;
        return Err(e.to_string());
    }
    let alive = |pid: i64| u32::try_from(pid).is_ok_and(|p| raw.procs.contains_key(&p));
    let alive_now: Vec<bool> = envs
        .iter()
        .flat_map(|e| &e.pids)
        .map(|p| alive(*p))
        .collect();
    // Both files as parsed last time, their pids as alive: last cycle's
    // result.
    if let (true, true, Some(c)) = (envs_held, devices_held, last) {
        if c.alive == alive_now {
            let shared = (Arc::clone(&c.envs), Arc::clone(&c.devices), c.garbled);
            parsed.cleaned = Some(c);
            return Ok(shared);
        }
    }
    let (mut envs, mut devices) = (envs.clone(), devices.clone());
    let garbled = envs_garbled + devices_garbled;
    // Kernels are taken as gone, as genv 1.4.3 finds them when run as root
    // (it looks in root's own Jupyter runtime directory): a record kept
    // alive by kernel ids alone is dropped, and processes carrying its id
    // are strays, left alone.
    genv::clean_up(&mut envs, &mut devices, alive, |_| false);
    genv::normalize(&mut envs, &mut devices);
    let (envs, devices) = (Arc::new(envs), Arc::new(devices));
    parsed.cleaned = (raw.envs.is_some() && raw.devices.is_some()).then(|| Cleaned {
        alive: alive_now,
        envs: Arc::clone(&envs),
        devices: Arc::clone(&devices),
        garbled,
    });
    Ok((envs, devices, garbled))
}

/// The uid a process of real uid `uid` is charged to, and its sub-uid
/// when that is not its own.
fn charged_uid(raw: &RawHost, uid: u32) -> (u32, Option<u32>) {
    match raw.sub_uids.get(&uid) {
        Some(Ok(owner)) => (*owner, Some(uid)),
        _ => (uid, None),
    }
}

/// The environment ids of a host's records, shared with the processes
/// that carry them: looked up by scan among a few, by hash among many
/// (past [`crate::model::SMALL`], as genv's clean-up does).
struct Ids<'e> {
    envs: &'e [Env],
    many: Option<crate::model::HashMap<&'e [u8], &'e EnvId>>,
}

impl<'e> Ids<'e> {
    fn of(envs: &'e [Env]) -> Self {
        let many = (envs.len() > crate::model::SMALL)
            .then(|| envs.iter().map(|e| (e.eid.0.as_bytes(), &e.eid)).collect());
        Ids { envs, many }
    }

    /// The id `value` spells: a record's, or one of its own.
    fn id(&self, value: &[u8]) -> EnvId {
        let known = match &self.many {
            Some(map) => map.get(value).copied(),
            None => self
                .envs
                .iter()
                .map(|e| &e.eid)
                .find(|id| id.0.as_bytes() == value),
        };
        match known {
            Some(id) => id.clone(),
            None => EnvId(String::from_utf8_lossy(value).into()),
        }
    }
}

fn process(raw: &RawHost, pid: Pid, gpus: crate::model::Gpus, ids: &Ids) -> Process {
    let unknown = |why: &str| Process {
        pid,
        owner: Owner::Unknown(why.to_string()),
        gpus: gpus.clone(),
        start_time: None,
        uid: None,
        user: None,
        sub_uid: None,
    };
    let (start_time, uid, environ) = match raw.procs.get(&pid.0) {
        None => return unknown(crate::model::EXITED),
        Some(RawProc::Unsure(why)) => return unknown(why),
        Some(RawProc::Seen {
            start_time,
            uid,
            environ,
        }) => (*start_time, *uid, environ),
    };
    let owner = match environ {
        Environ::Var(value) => Owner::Env(ids.id(value)),
        Environ::NoVar => Owner::NoEnv,
        Environ::Unreadable(why) => Owner::Unknown(why.clone()),
        Environ::Hidden(why) => Owner::Hidden(why.clone()),
        Environ::NotRead => Owner::Unknown("its environment was not read".into()),
    };
    let (uid, sub_uid) = match uid {
        Some(u) => {
            let (charged, sub) = charged_uid(raw, u);
            (Some(charged), sub)
        }
        None => (None, None),
    };
    let owner = match uid.and_then(|u| Some((u, raw.unnamed.get(&u)?))) {
        Some((u, why)) => Owner::Unknown(format!("its user (uid {u}) was not looked up: {why}")),
        None => owner,
    };
    Process {
        pid,
        owner,
        gpus,
        start_time: Some(start_time),
        uid,
        user: uid.and_then(|u| raw.user_names.get(&u).cloned()),
        sub_uid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Usage;

    const MAX: usize = genv::DEFAULT_MAX_RECORDS;

    fn seen(start_time: u64, uid: u32, environ: Environ<'static>) -> RawProc<'static> {
        RawProc::Seen {
            start_time,
            uid: Some(uid),
            environ,
        }
    }

    /// A recorded output of `fixtures/nvidia-smi/mps/` (its `# exit` line
    /// left out).
    fn mps_fixture(name: &str) -> String {
        crate::rules::test_support::recorded(&format!("mps/{name}"))
    }

    /// Issue 44's host: alice's MPS client 1040 in her environment `ea`,
    /// and the MPS server 1048 running as alice, carrying no environment;
    /// `role`: what the agent said of the server.
    fn mps_host(role: Option<RawMps>) -> RawHost<'static> {
        RawHost {
            gpus: mps_fixture("query-gpu.csv").into(),
            apps: mps_fixture("query-compute-apps.csv").into(),
            envs: Some(
                br#"{"envs": [{"eid": "ea", "uid": 1001, "creation": "x", "username": "alice", "config": {}, "pids": [1040], "kernel_ids": []}]}"#
                    .as_slice()
                    .into(),
            ),
            devices: Some(
                br#"{"devices": [{"index": 0, "total_memory": "143771mi", "attachments": [{"eid": "ea", "gpu_memory": null, "time": "t"}]}]}"#
                    .as_slice()
                    .into(),
            ),
            procs: [
                (1040, seen(500, 1001, Environ::Var(b"ea".as_slice().into()))),
                (1048, seen(510, 1001, Environ::NoVar)),
            ]
            .into_iter()
            .collect(),
            user_names: [(1001, "alice".into())].into_iter().collect(),
            mps: role.into_iter().map(|r| (1048, r)).collect(),
            ..Default::default()
        }
    }

    /// The pids the rules would terminate on the one host of `snap`.
    fn terminated(snap: HostSnapshot, policy: &crate::rules::Policy) -> Vec<u32> {
        let cluster = crate::rules::test_support::local(snap);
        crate::rules::evaluate(&cluster, policy)
            .iter()
            .flat_map(|v| &v.actions)
            .filter_map(|a| match a {
                crate::rules::Action::Terminate { pid, .. } => Some(pid.0),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_shared_mps_server_is_never_judged_and_its_memory_is_in_no_ones_count() {
        let snap = assemble(
            &mps_host(Some(RawMps::Shared)),
            "h",
            &mut ParsedState::default(),
            MAX,
        )
        .unwrap();
        assert_eq!(
            snap.processes.iter().map(|p| p.pid.0).collect::<Vec<_>>(),
            [1040]
        );
        let servers = &snap.truth.as_ref().unwrap().mps_servers;
        assert_eq!(servers.len(), 1);
        let s = &servers[0];
        assert_eq!(
            (s.pid.0, s.uid, s.user.as_deref()),
            (1048, Some(1001), Some("alice"))
        );
        assert_eq!(s.gpus[0].usage, Usage::Known(66 << 20), "its overhead");
        // Outside genv, yet never terminated; alice's 1540 MiB are all she
        // holds (at her cap, not over it).
        let policy = crate::rules::Policy {
            non_env_processes: true,
            max_memory_per_user: Some(1540 << 20),
            ..Default::default()
        };
        assert_eq!(terminated(snap.clone(), &policy), Vec::<u32>::new());
        let host = crate::model::HostId("h".into());
        let findings = crate::rules::assess_host(&host, &snap, &policy, &Default::default());
        assert!(findings.notices.iter().any(|n| matches!(
            n,
            crate::rules::Notice::MpsServer { pid: Pid(1048), bytes: Some(b), .. } if *b == 66 << 20
        )));
    }

    #[test]
    fn a_process_that_is_not_root_s_mps_server_is_judged_as_itself() {
        let policy = crate::rules::Policy {
            non_env_processes: true,
            ..Default::default()
        };
        // A user's own server (the agent says why it is not root's), and a
        // process merely named like one (the agent says nothing).
        let own = RawMps::Own("its parent (pid 1) is not a process of root".into());
        for role in [Some(own), None] {
            let snap = assemble(
                &mps_host(role.clone()),
                "h",
                &mut ParsedState::default(),
                MAX,
            )
            .unwrap();
            assert_eq!(snap.processes.len(), 2, "{role:?}");
            assert!(snap.truth.as_ref().unwrap().mps_servers.is_empty());
            let host = crate::model::HostId("h".into());
            let findings = crate::rules::assess_host(&host, &snap, &policy, &Default::default());
            let said = findings.notices.iter().any(|n| matches!(
                n,
                crate::rules::Notice::OwnMpsServer { pid: Pid(1048), reason, .. } if reason.contains("parent")
            ));
            assert_eq!(said, role.is_some(), "{role:?}");
            assert_eq!(terminated(snap, &policy), [1048], "{role:?}");
        }
        // Only a process whose identity was pinned is the server.
        let mut unsure = mps_host(Some(RawMps::Shared));
        unsure.procs.insert(1048, RawProc::Unsure("reused".into()));
        let snap = assemble(&unsure, "h", &mut ParsedState::default(), MAX).unwrap();
        assert!(snap.truth.as_ref().unwrap().mps_servers.is_empty());
        assert_eq!(snap.processes.len(), 2);
    }

    fn raw() -> RawHost<'static> {
        RawHost {
            groups: Default::default(),
            gpus: "GPU-a, 0, 81559\nGPU-b, 1, 81559\n".into(),
            apps: "GPU-a, 100, 50\nGPU-b, 200, [N/A]\nGPU-a, 300, 10\nGPU-a, 400, 1\nGPU-b, 500, 1\n"
                .into(),
            envs: Some(
                r#"{"envs": [{"eid": "e", "uid": 1001, "creation": "x", "username": "alice", "config": {}, "pids": [7, 100], "kernel_ids": []},
                {"eid": "dead", "uid": 0, "creation": "x", "username": "u", "config": {}, "pids": [999], "kernel_ids": []}]}"#
                    .as_bytes()
                    .into(),
            ),
            devices: Some(
                r#"{"devices": [{"index": 0, "total_memory": "1mi", "attachments": [{"eid": "e", "gpu_memory": null, "time": "t"}, {"eid": "dead", "gpu_memory": null, "time": "t"}]}]}"#
                    .as_bytes()
                    .into(),
            ),
            procs: [
                (7, seen(5, 1001, Environ::NotRead)),
                (100, seen(4242, 1001, Environ::Var(b"e".to_vec().into()))),
                (200, seen(77, 0, Environ::NoVar)),
                (
                    400,
                    seen(1, 1002, Environ::Unreadable("not enough permissions to read its environment".into())),
                ),
                (500, RawProc::Unsure("its pid was reused during the snapshot".into())),
            ]
            .into_iter()
            .collect(),
            user_names: [(1001, "alice".to_string())].into_iter().map(|(k, v)| (k, v.into())).collect(),
         ..Default::default()
}
    }

    #[test]
    fn a_pmon_that_does_not_parse_gives_no_process_a_figure_and_fails_nothing() {
        let mut r = raw();
        r.gpu_utilization = Some("0, 3\n1, 0\n".into());
        r.pmon = Some("    0 100 C x\n".into());
        let snap = assemble(&r, "h", &mut ParsedState::default(), MAX).unwrap();
        let u = snap.utilization.unwrap();
        assert_eq!(u.processes, None);
        assert_eq!(u.gpus.len(), 2);
        r.pmon = Some("# gpu pid type sm\n    0 100 C 7\n".into());
        let snap = assemble(&r, "h", &mut ParsedState::default(), MAX).unwrap();
        assert_eq!(snap.utilization.unwrap().processes.unwrap()[0].sm, Some(7));
    }

    #[test]
    fn identity_owners_clean_up_and_truth() {
        let s = assemble(&raw(), "gpu1", &mut ParsedState::default(), MAX).unwrap();
        assert_eq!(s.envs.len(), 1, "the env without live pids is dropped");
        assert_eq!(s.envs[0].pids, [7, 100]);
        assert_eq!(s.devices[0].attachments.len(), 1);
        let p = |n| s.process(Pid(n)).unwrap();
        assert_eq!(p(100).owner, Owner::Env(EnvId("e".into())));
        assert_eq!((p(100).start_time, p(100).uid), (Some(4242), Some(1001)));
        assert_eq!(p(100).user.as_deref(), Some("alice"));
        assert_eq!(p(200).owner, Owner::NoEnv);
        assert_eq!(p(200).gpus[0].usage, Usage::Unknown);
        assert_eq!(
            p(300).owner,
            Owner::Unknown("it exited during the snapshot".into())
        );
        assert!(matches!(&p(400).owner, Owner::Unknown(w) if w.contains("permissions")));
        assert!(matches!(&p(500).owner, Owner::Unknown(w) if w.contains("reused")));
        assert_eq!((p(500).start_time, p(500).uid), (None, None));
        let truth = s.truth.unwrap();
        assert_eq!(
            truth.pid_uids,
            [(7, 1001), (100, 1001)].into_iter().collect()
        );
        assert_eq!(truth.user_names.get(&1001).map(|n| &**n), Some("alice"));
    }

    #[test]
    fn a_sub_uid_is_charged_to_its_ranges_owner_and_an_unresolved_one_said() {
        let mut r = raw();
        r.procs.insert(300, seen(9, 300_001, Environ::NoVar));
        r.procs.insert(400, seen(9, 400_000, Environ::NoVar));
        r.sub_uids.insert(300_001, Ok(1002));
        r.sub_uids
            .insert(400_000, Err("in the sub-uid ranges of bob, carol".into()));
        r.user_names.insert(1002, "bob".into());
        let s = assemble(&r, "h", &mut ParsedState::default(), MAX).unwrap();
        let p = s.process(Pid(300)).unwrap();
        assert_eq!(
            (p.uid, p.sub_uid, p.user.as_deref()),
            (Some(1002), Some(300_001), Some("bob"))
        );
        let p = s.process(Pid(400)).unwrap();
        assert_eq!((p.uid, p.sub_uid), (Some(400_000), None));
        let truth = s.truth.unwrap();
        assert_eq!(
            truth.unresolved_uids[&400_000],
            "in the sub-uid ranges of bob, carol"
        );
        // A listed pid of a sub-uid vouches for its owner.
        let mut r = raw();
        r.procs.insert(7, seen(5, 300_001, Environ::NotRead));
        r.sub_uids.insert(300_001, Ok(1002));
        let s = assemble(&r, "h", &mut ParsedState::default(), MAX).unwrap();
        assert_eq!(s.truth.unwrap().pid_uids[&7], 1002);
    }

    #[test]
    fn a_process_whose_users_name_was_not_looked_up_is_unknown_and_counted() {
        let mut r = raw();
        r.procs
            .insert(300, seen(9, 300_001, Environ::Var(b"e".as_slice().into())));
        r.sub_uids.insert(300_001, Ok(1002));
        r.unnamed.insert(
            1002,
            "the name service did not answer within the step".into(),
        );
        let s = assemble(&r, "h", &mut ParsedState::default(), MAX).unwrap();
        let p = s.process(Pid(300)).unwrap();
        assert_eq!(
            p.owner,
            Owner::Unknown(
                "its user (uid 1002) was not looked up: the name service did not answer within the step"
                    .into()
            )
        );
        assert_eq!(
            (p.uid, p.sub_uid, p.user.as_deref()),
            (Some(1002), Some(300_001), None)
        );
        assert_eq!(
            s.process(Pid(200)).unwrap().owner,
            Owner::NoEnv,
            "others as they are"
        );
    }

    #[test]
    fn a_hidden_environ_is_judged_as_carrying_none() {
        let mut r = raw();
        r.procs
            .insert(300, seen(9, 1001, Environ::Hidden("hung".into())));
        let s = assemble(&r, "h", &mut ParsedState::default(), MAX).unwrap();
        assert_eq!(
            s.process(Pid(300)).unwrap().owner,
            Owner::Hidden("hung".into())
        );
        assert_eq!(s.process(Pid(300)).unwrap().owner.eid(), None);
    }

    #[test]
    fn any_eid_bytes_stay_one_value() {
        let mut r = raw();
        r.procs.insert(
            300,
            seen(
                9,
                0,
                Environ::Var(b"$(touch /tmp/x)\n\x01; rm -rf /\r".to_vec().into()),
            ),
        );
        let s = assemble(&r, "h", &mut ParsedState::default(), MAX).unwrap();
        assert_eq!(
            s.process(Pid(300)).unwrap().owner,
            Owner::Env(EnvId("$(touch /tmp/x)\n\u{1}; rm -rf /\r".into()))
        );
    }

    #[test]
    fn unusable_genv_state_degrades_the_host_and_unparseable_tools_fail_it() {
        let mut r = raw();
        r.envs = Some(b"{\"envs\": [{\"eid\": 7}]}".as_slice().into());
        let s = assemble(&r, "gpu1", &mut ParsedState::default(), MAX).unwrap();
        let problem = s.state_problem().unwrap();
        assert!(problem.starts_with("envs.json: "), "{problem}");
        assert!(s.envs.is_empty());
        assert_eq!(s.devices.len(), 2, "the GPUs, with no attachment known");
        assert!(s.devices.iter().all(|d| d.attachments.is_empty()));
        // The processes are still there, with their owners.
        assert_eq!(s.process(Pid(100)).unwrap().uid, Some(1001));
        for (part, why) in [
            ("envs", "/var/tmp/genv/envs.json is a FIFO: refused"),
            ("dir", "/var/tmp/genv did not answer within 30s"),
        ] {
            let mut r = raw();
            r.state_errors.insert(part.into(), why.into());
            let s = assemble(&r, "gpu1", &mut ParsedState::default(), MAX).unwrap();
            assert_eq!(s.state_problem(), Some(why));
        }
        // Over the limit: refused, and not kept for the next cycle.
        let mut parsed = ParsedState::default();
        let s = assemble(&raw(), "gpu1", &mut parsed, 2).unwrap();
        assert!(s.state_problem().unwrap().contains("--max-records"));
        assert!(s.state_problem().unwrap().starts_with("envs.json: "));
        assert!(parsed.envs.is_none());
        assert!(assemble(&raw(), "gpu1", &mut parsed, 5)
            .unwrap()
            .state_problem()
            .is_none());
        assert!(parsed.envs.is_some() && parsed.devices.is_some());
        let mut r = raw();
        let attached = r#"{"eid": "e", "gpu_memory": null, "time": "t"}"#;
        r.devices = file(format!(
            r#"{{"devices": [{{"index": 0, "total_memory": "1mi", "attachments": [{}]}}]}}"#,
            [attached; 5].join(", ")
        ));
        let s = assemble(&r, "gpu1", &mut parsed, 5).unwrap();
        assert!(s.state_problem().unwrap().starts_with("devices.json: "));
        assert!(parsed.envs.is_some() && parsed.devices.is_none());
        let mut r = raw();
        r.apps = "GPU-z, 1, 1\n".into();
        assert!(assemble(&r, "gpu1", &mut ParsedState::default(), MAX)
            .unwrap_err()
            .to_string()
            .contains("unknown GPU uuid"));
        let r = RawHost {
            envs: None,
            devices: None,
            ..raw()
        };
        let s = assemble(&r, "h", &mut ParsedState::default(), MAX).unwrap();
        assert_eq!(s.devices.len(), 2, "devices as genv creates them");
    }

    /// A state file that holds `text`.
    fn file(text: impl Into<String>) -> Option<Cow<'static, [u8]>> {
        Some(text.into().into_bytes().into())
    }

    /// `envs` with bob's name where alice's was.
    fn bob_for_alice(envs: Option<Cow<'_, [u8]>>) -> Option<Cow<'static, [u8]>> {
        let text = String::from_utf8(envs?.into_owned()).unwrap();
        file(text.replace("\"alice\"", "\"bob\""))
    }

    #[test]
    fn unchanged_state_is_not_parsed_again_and_changed_state_is() {
        let mut parsed = ParsedState::default();
        let first = assemble(&raw(), "h", &mut parsed, MAX).unwrap();
        let cached = parsed.envs.as_ref().unwrap().1.clone();
        assert_eq!(assemble(&raw(), "h", &mut parsed, MAX).unwrap(), first);
        // What is cached is the parse before clean-up: the dead env is there.
        assert_eq!(cached.len(), 2);
        let mut r = raw();
        r.envs = bob_for_alice(r.envs);
        let changed = assemble(&r, "h", &mut parsed, MAX).unwrap();
        assert_eq!(changed.envs[0].username.as_deref(), Some("bob"));
        r.envs = file("{");
        assert!(assemble(&r, "h", &mut parsed, MAX)
            .unwrap()
            .state_problem()
            .is_some());
        assert_eq!(
            parsed.envs.as_ref().unwrap().1[0].username.as_deref(),
            Some("bob")
        );
        // Bytes that are not UTF-8 (a user may write any): the state is
        // unusable, said where; the host and the cache are kept.
        let mut garbled = bob_for_alice(raw().envs).unwrap().into_owned();
        garbled[20] = 0xff;
        r.envs = Some(garbled.into());
        let s = assemble(&r, "h", &mut parsed, MAX).unwrap();
        assert_eq!(s.state_problem(), Some("envs.json: byte 20: not UTF-8"));
        assert_eq!(s.processes.len(), first.processes.len());
        assert_eq!(
            parsed.envs.as_ref().unwrap().1[0].username.as_deref(),
            Some("bob")
        );
        r.envs = raw().envs;
        r.devices = Some(b"{\"devices\": [\xc3]}".as_slice().into());
        let s = assemble(&r, "h", &mut parsed, MAX).unwrap();
        assert_eq!(s.state_problem(), Some("devices.json: byte 13: not UTF-8"));
    }

    #[test]
    fn a_steady_state_is_shared_and_any_change_cleans_up_anew() {
        let mut parsed = ParsedState::default();
        let first = assemble(&raw(), "h", &mut parsed, MAX).unwrap();
        let again = assemble(&raw(), "h", &mut parsed, MAX).unwrap();
        assert!(Arc::ptr_eq(&first.envs, &again.envs));
        assert!(Arc::ptr_eq(&first.devices, &again.devices));
        // A listed pid ends: "e" keeps 100 only.
        let mut r = raw();
        r.procs.remove(&7);
        let fewer = assemble(&r, "h", &mut parsed, MAX).unwrap();
        assert!(!Arc::ptr_eq(&first.envs, &fewer.envs));
        assert_eq!(fewer.envs[0].pids, vec![100]);
        assert_eq!(first.envs[0].pids, vec![7, 100]);
        // The dead env's pid comes back: its record and attachment too.
        let mut r = raw();
        r.procs.insert(999, seen(1, 0, Environ::NotRead));
        let back = assemble(&r, "h", &mut parsed, MAX).unwrap();
        assert_eq!((back.envs.len(), back.devices[0].attachments.len()), (2, 2));
        // envs.json changes and devices.json then fails to parse: the
        // next cycle, with devices.json as before, sees the new envs.json.
        let mut r = raw();
        r.envs = bob_for_alice(r.envs);
        r.devices = file("{");
        assert!(assemble(&r, "h", &mut parsed, MAX)
            .unwrap()
            .state_problem()
            .is_some());
        r.devices = raw().devices;
        let s = assemble(&r, "h", &mut parsed, MAX).unwrap();
        assert_eq!(s.envs[0].username.as_deref(), Some("bob"));
        // Without devices.json the devices are nvidia-smi's; with it back
        // (as parsed before), its attachments.
        r.devices = None;
        let s = assemble(&r, "h", &mut parsed, MAX).unwrap();
        assert!(s.devices.iter().all(|d| d.attachments.is_empty()));
        r.devices = raw().devices;
        let s = assemble(&r, "h", &mut parsed, MAX).unwrap();
        assert_eq!(s.devices[0].attachments.len(), 1);
        // A state error, then the same files: the same as before it.
        r.state_errors.insert("envs".into(), "refused".into());
        assert!(assemble(&r, "h", &mut parsed, MAX).unwrap().envs.is_empty());
        r.state_errors.clear();
        assert_eq!(assemble(&r, "h", &mut parsed, MAX).unwrap(), s);
    }

    #[test]
    fn a_process_shares_its_records_id_among_few_or_many_and_keeps_its_own_else() {
        for n in [1, 16, 17, 40] {
            let envs: Vec<String> = (0..n)
                .map(|i| format!(r#"{{"eid": "e{i}", "uid": 1001, "creation": "x", "username": "alice", "config": {{}}, "pids": [100], "kernel_ids": []}}"#))
                .collect();
            let mut r = raw();
            r.envs = file(format!(r#"{{"envs": [{}]}}"#, envs.join(",")));
            let last = format!("e{}", n - 1);
            r.procs.insert(
                100,
                seen(4242, 1001, Environ::Var(last.clone().into_bytes().into())),
            );
            r.procs
                .insert(300, seen(9, 1001, Environ::Var(b"e\xff".to_vec().into())));
            let s = assemble(&r, "h", &mut ParsedState::default(), MAX).unwrap();
            let owner = |pid| s.process(Pid(pid)).unwrap().owner.eid().unwrap().clone();
            let record = s.env(&EnvId(last.as_str().into())).unwrap();
            assert!(Arc::ptr_eq(&owner(100).0, &record.eid.0), "{n} records");
            assert_eq!(&*owner(300).0, "e\u{fffd}");
            // Linear among many: a hash past 16 records, not a scan each.
            assert_eq!(Ids::of(&s.envs).many.is_some(), n > 16, "{n} records");
        }
    }
}
