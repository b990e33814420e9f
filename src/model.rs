//! The domain model: ids, host snapshots and the merged cluster snapshot.
//!
//! Everything here is plain data. Parsers in [`crate::snapshot`] build it,
//! [`crate::rules`] reads it; nothing here does I/O.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A host's name as the admin gave it (`localhost` in local mode).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct HostId(pub Arc<str>);

impl HostId {
    /// A host name from the admin's input: one word of printable
    /// characters, no `/` (it names files: `<dir>/<host>.json`, sockets),
    /// not an option (`-...`), at most 255 bytes.
    ///
    /// # Errors
    /// Says what is wrong with `name`.
    pub fn new(name: &str) -> Result<HostId, String> {
        let bad = |why: &str| Err(format!("bad host name {name:?}: {why}"));
        if name.is_empty() {
            return bad("empty");
        }
        if name.len() > 255 {
            return bad("longer than 255 bytes");
        }
        if name.starts_with('-') {
            return bad("starts with '-'");
        }
        if name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '/')
        {
            return bad("holds a space, a control character or '/'");
        }
        Ok(HostId(name.into()))
    }
}

/// Why a host failed this cycle: what kind of step failed (metrics count
/// it, doctor advises on it) and the whole account (reports show it; the
/// JSON output writes only this text, as before).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFailure {
    pub kind: FailureKind,
    pub message: String,
}

impl HostFailure {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        HostFailure {
            kind,
            message: message.into(),
        }
    }
}

impl Serialize for HostFailure {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.message)
    }
}

impl fmt::Display for HostFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The kinds of step a host can fail at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// ssh could not connect, and why.
    Connect(ConnectFailure),
    /// sudo would not run the agent without a password.
    Sudo,
    /// A step ran past its deadline.
    Timeout,
    /// The agent could not be started, ended, or broke its protocol.
    Agent,
    /// genv's state could not be read or written safely.
    State,
    /// genv's lock stayed held.
    Lock,
    /// nvidia-smi failed or hung.
    NvidiaSmi,
    /// The host's agent refused us: another leader acted there since.
    Fenced,
    /// The host's fence (high availability) cannot be used safely.
    Fence,
    /// What the host sent could not be parsed (or was too large).
    Parse,
    /// A recorded snapshot could not be read.
    Recorded,
    /// The host answered, but its genv state could not be used (the audit
    /// log's word for a degraded host; no snapshot failed).
    Degraded,
    /// A fault on our side: a worker failed (a bug), a file of ours could
    /// not be written.
    Internal,
}

impl FailureKind {
    /// Its name in metrics' labels.
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::Connect(why) => match why {
                ConnectFailure::Refused => "connect-refused",
                ConnectFailure::Unreachable => "unreachable",
                ConnectFailure::UnknownHost => "unknown-host",
                ConnectFailure::Auth => "auth",
                ConnectFailure::HostKey => "host-key",
                ConnectFailure::Other => "connect",
            },
            FailureKind::Sudo => "sudo",
            FailureKind::Timeout => "timeout",
            FailureKind::Agent => "agent",
            FailureKind::State => "state",
            FailureKind::Lock => "lock",
            FailureKind::NvidiaSmi => "nvidia-smi",
            FailureKind::Fenced => "fenced",
            FailureKind::Fence => "fence",
            FailureKind::Parse => "parse",
            FailureKind::Recorded => "recorded",
            FailureKind::Degraded => "degraded",
            FailureKind::Internal => "internal",
        }
    }
}

/// Why ssh could not connect, as far as its words tell: what an admin fixes
/// differs for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConnectFailure {
    /// Nothing listens on the port.
    Refused,
    /// The host or its network does not answer.
    Unreachable,
    /// The name does not resolve.
    UnknownHost,
    /// The key was refused (or a password would be needed).
    Auth,
    /// The host key is unknown or changed.
    HostKey,
    /// Anything else.
    Other,
}

impl ConnectFailure {
    /// Classifies what ssh said when it gave up.
    pub fn of(said: &str) -> Self {
        let s = said.to_ascii_lowercase();
        if s.contains("host key verification failed")
            || s.contains("remote host identification has changed")
            || s.contains("no matching host key")
        {
            ConnectFailure::HostKey
        } else if s.contains("permission denied") || s.contains("too many authentication failures")
        {
            ConnectFailure::Auth
        } else if s.contains("connection refused") {
            ConnectFailure::Refused
        } else if s.contains("could not resolve hostname")
            || s.contains("name or service not known")
        {
            ConnectFailure::UnknownHost
        } else if s.contains("timed out")
            || s.contains("no route to host")
            || s.contains("network is unreachable")
        {
            ConnectFailure::Unreachable
        } else {
            ConnectFailure::Other
        }
    }
}

/// A process id on one host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Pid(pub u32);

/// A GPU index on one host, as nvidia-smi and genv number them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GpuIndex(pub u32);

/// A genv environment id (`GENV_ENVIRONMENT_ID`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EnvId(pub Arc<str>);

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl fmt::Display for Pid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
impl fmt::Display for GpuIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
impl fmt::Display for EnvId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A memory amount as genv writes it (`"2gi"`), with its value in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Memory {
    /// The string as written in the state file, printed back in messages.
    pub text: String,
    /// The value in bytes.
    pub bytes: u64,
}

/// How much memory a process uses on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Usage {
    /// Measured by nvidia-smi, in bytes.
    Known(u64),
    /// nvidia-smi printed `[N/A]` or `[Not Supported]`: never taken as 0.
    Unknown,
}

impl Usage {
    /// The bytes if known.
    pub fn bytes(self) -> Option<u64> {
        match self {
            Usage::Known(b) => Some(b),
            Usage::Unknown => None,
        }
    }
}

/// One GPU a process runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceUsage {
    pub index: GpuIndex,
    pub usage: Usage,
}

/// Why a GPU process has no owner when its pid was not alive: the driver
/// lists memory for a pid that no live process has (it ended during the
/// snapshot, or the driver holds memory no process owns).
pub const EXITED: &str = "it exited during the snapshot";

/// Which environment a process belongs to, as far as we could tell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum Owner {
    /// Its environ holds `GENV_ENVIRONMENT_ID=<eid>`.
    Env(EnvId),
    /// Its environ was read and holds no `GENV_ENVIRONMENT_ID`.
    NoEnv,
    /// Its environ could not be read (permissions, vanished): never acted on.
    Unknown(String),
    /// Its environ cannot be read for a reason the process itself controls
    /// (larger than any program can be started with, a read that fails on
    /// its memory or hangs): judged as carrying no `GENV_ENVIRONMENT_ID`,
    /// which it could have had by unsetting it, and said each cycle.
    Hidden(String),
}

impl Owner {
    /// The environment id, if the process has one.
    pub fn eid(&self) -> Option<&EnvId> {
        match self {
            Owner::Env(eid) => Some(eid),
            _ => None,
        }
    }
}

/// Up to this many items (records, devices, apps), a plain scan beats
/// hashing (and allocates nothing): real state is this small; more takes
/// the hashed, linear path.
pub const SMALL: usize = 16;

/// A hash map for the per-host work, keyed by what users write (pids,
/// eids, names): aHash with random keys, as [`ahash::RandomState`] makes
/// them, but made once per thread and copied after, so that workers do
/// not share the one counter `RandomState::new` bumps for every map.
pub type HashMap<K, V> = std::collections::HashMap<K, V, ThreadKeys>;

/// Entries in the order they came, each key once: found by a plain scan
/// while there are few, by hash past [`SMALL`] (linear either way in what
/// users write).
#[derive(Debug, Clone)]
pub struct Few<K, V> {
    entries: Vec<(K, V)>,
    index: Option<HashMap<K, usize>>,
}

impl<K, V> Default for Few<K, V> {
    fn default() -> Self {
        Few {
            entries: Vec::new(),
            index: None,
        }
    }
}

impl<K: Eq + std::hash::Hash + Clone, V> Few<K, V> {
    /// Room for `n` entries, hashed from the first if that is many.
    pub fn with_capacity(n: usize) -> Self {
        Few {
            entries: Vec::with_capacity(n),
            index: (n > SMALL).then(|| HashMap::with_capacity_and_hasher(n, Default::default())),
        }
    }

    /// The place of `key`'s entry, if it has one.
    pub fn position(&self, key: &K) -> Option<usize> {
        match &self.index {
            Some(index) => index.get(key).copied(),
            None => self.entries.iter().position(|(k, _)| k == key),
        }
    }

    /// `key`'s value, if it has one.
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let i = self.position(key)?;
        Some(&mut self.entries[i].1)
    }

    /// `key`'s value, made by `new` (and put last) if it had none.
    pub fn get_or_insert_with(&mut self, key: K, new: impl FnOnce() -> V) -> &mut V {
        let i = match self.position(&key) {
            Some(i) => i,
            None => {
                let i = self.entries.len();
                if let Some(index) = &mut self.index {
                    index.insert(key.clone(), i);
                }
                self.entries.push((key, new()));
                if self.index.is_none() && self.entries.len() > SMALL {
                    let keys = self.entries.iter().enumerate();
                    self.index = Some(keys.map(|(i, (k, _))| (k.clone(), i)).collect());
                }
                i
            }
        };
        &mut self.entries[i].1
    }

    /// Whether it finds keys by hash (past [`SMALL`]).
    #[cfg(test)]
    pub(crate) fn hashed(&self) -> bool {
        self.index.is_some()
    }

    /// The keys, in the order they came.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.entries.iter().map(|(k, _)| k)
    }

    /// The entries, in the order they came.
    pub fn into_entries(self) -> Vec<(K, V)> {
        self.entries
    }
}

/// This thread's random aHash keys (see [`HashMap`]).
#[derive(Clone)]
pub struct ThreadKeys(ahash::RandomState);

impl Default for ThreadKeys {
    fn default() -> Self {
        thread_local!(static KEYS: ahash::RandomState = ahash::RandomState::new());
        ThreadKeys(KEYS.with(Clone::clone))
    }
}

impl std::hash::BuildHasher for ThreadKeys {
    type Hasher = ahash::AHasher;

    fn build_hasher(&self) -> ahash::AHasher {
        self.0.build_hasher()
    }
}

/// The GPUs a process runs on: nearly always one, kept inline.
pub type Gpus = smallvec::SmallVec<[DeviceUsage; 1]>;

/// A few GPU indices (a process's, a finding's), kept inline up to four.
pub type Indices = smallvec::SmallVec<[GpuIndex; 4]>;

/// A GPU compute process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Process {
    pub pid: Pid,
    pub owner: Owner,
    /// One entry per GPU, in nvidia-smi order.
    pub gpus: Gpus,
    pub start_time: Option<u64>,
    /// The uid it is charged to: its real uid, or the owner of the
    /// subordinate range its real uid is in (`sub_uid`).
    pub uid: Option<u32>,
    pub user: Option<Arc<str>>,
    /// Its real uid where that is a sub-uid of `uid`'s range.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sub_uid: Option<u32>,
}

impl Process {
    /// The GPU indices it runs on.
    pub fn indices(&self) -> impl Iterator<Item = GpuIndex> + '_ {
        self.gpus.iter().map(|g| g.index)
    }

    /// Its usage on one GPU, if it runs there.
    pub fn usage_on(&self, index: GpuIndex) -> Option<Usage> {
        self.gpus.iter().find(|g| g.index == index).map(|g| g.usage)
    }
}

/// A genv environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Env {
    pub eid: EnvId,
    pub uid: u32,
    pub username: Option<String>,
    pub creation: String,
    pub name: Option<String>,
    pub gpu_memory: Option<Memory>,
    pub gpus: Option<u32>,
    /// As recorded: any JSON integer (a forged record may hold a negative
    /// or huge one), hence not a [`Pid`]; matched against real pids only.
    pub pids: Vec<i64>,
    pub kernel_ids: Vec<String>,
}

/// An environment's attachment to a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Attachment {
    pub eid: EnvId,
    pub gpu_memory: Option<String>,
    pub time: String,
}

/// A GPU with the environments attached to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Device {
    pub index: GpuIndex,
    pub total_memory: String,
    pub attachments: Vec<Attachment>,
}

impl Device {
    /// Whether `eid` is attached here.
    pub fn has(&self, eid: &EnvId) -> bool {
        self.attachments.iter().any(|a| &a.eid == eid)
    }
}

/// What the host itself says about who runs what, beside genv's records
/// (which any user can write): each GPU process's uid is in
/// [`Process::uid`]; here, the owners of the pids records list, and the
/// host's names for the uids seen.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HostTruth {
    /// The real uid of every live pid that an environment lists. Any user
    /// can list any pid: this never says whose an environment is, it only
    /// orders what a device cap detaches.
    pub pid_uids: BTreeMap<i64, u32>,
    /// The host's names for the uids seen (listed pids and GPU processes).
    pub user_names: BTreeMap<u32, Arc<str>>,
    /// The groups asked about (exemptions', caps') each uid seen (a GPU
    /// process's or a listed pid's owner) is a member of on the host, as
    /// far as its name service answered by the deadline.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub groups: BTreeMap<u32, Vec<String>>,
    /// The host's clock for process start times, when it said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot: Option<Boot>,
    /// Why genv's state could not be used this cycle (a file refused,
    /// garbled or over its limits): the host is degraded, and only what
    /// needs no genv state is judged there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_problem: Option<String>,
    /// Records and attachments of genv's state ignored for an id or user
    /// name over [`crate::snapshot::genv::MAX_NAME`] bytes.
    #[serde(skip_serializing_if = "is_zero")]
    pub garbled_records: usize,
    /// Who held genv's lock past the agent's short wait (the state was
    /// read without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lock_held: Option<String>,
    /// Uids seen that have no name on the host and could not be resolved
    /// to one sub-uid range's owner, and why.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub unresolved_uids: BTreeMap<u32, String>,
    /// The machine's shared CUDA MPS servers, which no rule judges (they
    /// are not among the snapshot's processes).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mps_servers: Vec<MpsServer>,
    /// GPU processes that run the driver's MPS server file but are no
    /// shared server (a user's own), and why not: judged as any process.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub own_mps_servers: BTreeMap<Pid, String>,
}

/// The machine's shared CUDA MPS server: the kernel says root's
/// `nvidia-cuda-mps-control` started it from the driver's root-owned
/// `nvidia-cuda-mps-server` file (the agent's `mps_role`). It runs every
/// client's kernels, so terminating it would end them all: it is never
/// judged, and its memory is overhead on its GPUs, in no one's count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MpsServer {
    pub pid: Pid,
    pub start_time: Option<u64>,
    /// The user it runs as: the control daemon starts it as the user of
    /// its first client.
    pub uid: Option<u32>,
    pub user: Option<Arc<str>>,
    /// Its memory on each of its GPUs.
    pub gpus: Gpus,
}

/// What turns a process's start time (clock ticks since boot, as `/proc`
/// says) into a time comparable across hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Boot {
    /// When the host booted, in seconds since the Unix epoch (`btime`).
    pub btime: u64,
    /// Clock ticks per second (`SC_CLK_TCK`), never 0.
    pub hz: u64,
}

impl Boot {
    /// A start time in milliseconds since the Unix epoch.
    pub fn started_ms(self, ticks: u64) -> u64 {
        let ms =
            u128::from(self.btime) * 1000 + u128::from(ticks) * 1000 / u128::from(self.hz.max(1));
        u64::try_from(ms).unwrap_or(u64::MAX)
    }
}

/// How busy each GPU and each process on it was, as the driver said when
/// asked (the idle rule).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Utilization {
    /// `nvidia-smi pmon -c 1 -s u`: what it listed, or `None` when it
    /// failed or is not supported (MIG): then no process's own figure is
    /// known.
    pub processes: Option<Vec<ProcessUtilization>>,
    /// `--query-gpu=index,utilization.gpu`: each GPU's, where a number.
    pub gpus: BTreeMap<GpuIndex, u32>,
}

/// One line of `nvidia-smi pmon -s u`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessUtilization {
    pub index: GpuIndex,
    pub pid: Pid,
    /// SM utilization in percent; `None` where pmon printed `-`: no kernel
    /// of the process ran in its sampling window.
    pub sm: Option<u32>,
    /// A CUDA MPS client (type `M+C` or `M`): its kernels run on the MPS
    /// server, so its own `-` says nothing of its work.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub mps_client: bool,
}

impl HostTruth {
    /// The groups the host said `uid` is a member of.
    pub fn groups_of(&self, uid: u32) -> &[String] {
        self.groups.get(&uid).map_or(&[], Vec::as_slice)
    }
}

/// What one host looked like at one moment, in genv's order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HostSnapshot {
    pub processes: Vec<Process>,
    /// Shared with the host's parse of its unchanged state files (see
    /// [`crate::snapshot::assemble::ParsedState`]): a steady cycle copies
    /// none of them.
    pub envs: Arc<Vec<Env>>,
    pub devices: Arc<Vec<Device>>,
    /// `None` for a recorded genv snapshot: its records are all there is.
    pub truth: Option<HostTruth>,
    /// How busy its GPUs and processes were, when asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub utilization: Option<Utilization>,
    /// A recording's word on its users' groups (a live host's are in
    /// `truth`, by uid).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub recorded_groups: BTreeMap<String, Vec<String>>,
}

impl HostSnapshot {
    /// Why its genv state could not be used this cycle, if so.
    pub fn state_problem(&self) -> Option<&str> {
        self.truth.as_ref()?.state_problem.as_deref()
    }

    /// The environment with this id.
    pub fn env(&self, eid: &EnvId) -> Option<&Env> {
        self.envs.iter().find(|e| &e.eid == eid)
    }

    /// The process with this pid.
    pub fn process(&self, pid: Pid) -> Option<&Process> {
        self.processes.iter().find(|p| p.pid == pid)
    }

    /// Indices of the devices `eid` is attached to, in device order.
    pub fn attached(&self, eid: &EnvId) -> Vec<GpuIndex> {
        self.devices
            .iter()
            .filter(|d| d.has(eid))
            .map(|d| d.index)
            .collect()
    }

    /// When a process started, comparable across hosts where the host said
    /// its clock (milliseconds since the Unix epoch); a recording's start
    /// times as they are.
    pub fn started(&self, p: &Process) -> Option<u64> {
        let ticks = p.start_time?;
        match self.truth.as_ref().map(|t| t.boot) {
            Some(Some(boot)) => Some(boot.started_ms(ticks)),
            Some(None) => None,
            None => Some(ticks),
        }
    }

    /// The processes of `eid`, in snapshot order.
    pub fn processes_of<'a>(&'a self, eid: &'a EnvId) -> impl Iterator<Item = &'a Process> {
        self.processes
            .iter()
            .filter(move |p| p.owner.eid() == Some(eid))
    }
}

/// Whether messages name hosts (remote) or not (local `genv enforce`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Local,
    Remote,
}

/// The snapshots of all hosts that answered this cycle, in the order given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cluster {
    pub mode: Mode,
    pub hosts: Vec<(HostId, HostSnapshot)>,
}

impl Cluster {
    /// A one-host cluster for local mode.
    pub fn local(host: HostId, snapshot: HostSnapshot) -> Self {
        Cluster {
            mode: Mode::Local,
            hosts: vec![(host, snapshot)],
        }
    }

    /// Merges host results in the given order; hosts that failed are left out
    /// (their devices are simply not seen this cycle).
    pub fn merge<E>(
        mode: Mode,
        results: impl IntoIterator<Item = (HostId, Result<HostSnapshot, E>)>,
    ) -> Self {
        Cluster {
            mode,
            hosts: results
                .into_iter()
                .filter_map(|(h, r)| r.ok().map(|s| (h, s)))
                .collect(),
        }
    }

    /// The snapshot of one host.
    pub fn host(&self, host: &HostId) -> Option<&HostSnapshot> {
        self.hosts.iter().find(|(h, _)| h == host).map(|(_, s)| s)
    }
}

/// `items` as `a,b,c`.
pub fn comma_list<T: std::fmt::Display>(items: &[T]) -> String {
    items.iter().map(T::to_string).collect::<Vec<_>>().join(",")
}

/// Whether `n` is 0 (a field left out of JSON then).
pub fn is_zero<N: Default + PartialEq>(n: &N) -> bool {
    *n == N::default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_finds_each_key_once_by_scan_and_by_hash_in_the_order_they_came() {
        let mut few: Few<String, usize> = Few::default();
        let key = |k: usize| format!("k{}", (k * 7) % 50);
        for n in 0..3 * SMALL {
            // Each key once: a second insert finds the first.
            *few.get_or_insert_with(key(n), || 0) += 1;
            *few.get_or_insert_with(key(n), || 100) += 1;
            // Scan (up to SMALL) and hash (past it) find the same.
            assert!(few.index.is_some() == (n + 1 > SMALL), "{n}");
            for m in 0..=n {
                assert_eq!(few.position(&key(m)), Some(m), "{n} {m}");
            }
            assert_eq!(few.position(&key(n + 1)), None);
            assert!(few.get_mut(&"nobody".to_string()).is_none());
        }
        *few.get_mut(&key(SMALL + 3)).unwrap() += 5;
        let entries = few.into_entries();
        let keys: Vec<String> = (0..3 * SMALL).map(key).collect();
        assert_eq!(
            entries.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            keys.iter().collect::<Vec<_>>()
        );
        assert!(entries
            .iter()
            .enumerate()
            .all(|(i, (_, v))| *v == if i == SMALL + 3 { 7 } else { 2 }));
    }

    #[test]
    fn few_made_for_many_hashes_from_the_first_and_for_a_few_scans() {
        for (n, hashed) in [(0, false), (SMALL, false), (SMALL + 1, true), (1000, true)] {
            let mut few: Few<u32, u32> = Few::with_capacity(n);
            assert_eq!(few.index.is_some(), hashed, "{n}");
            for k in 0..n as u32 {
                *few.get_or_insert_with(k % 7, || k) += 1;
            }
            let keys: Vec<u32> = few.keys().copied().collect();
            let want: Vec<(u32, u32)> = (0..7u32.min(n as u32))
                .map(|k| (k, k + (n as u32 - k).div_ceil(7)))
                .collect();
            assert_eq!(keys, want.iter().map(|(k, _)| *k).collect::<Vec<_>>());
            assert_eq!(few.into_entries(), want, "{n}");
        }
    }

    #[test]
    fn maps_hash_with_this_threads_random_keys_not_fixed_ones() {
        use std::hash::BuildHasher;
        // Users pick the keys (eids, names): fixed keys would let one
        // craft collisions. Random keys agree with aHash's fixed ones
        // on a value with probability 2^-64.
        let fixed = std::hash::BuildHasherDefault::<ahash::AHasher>::default();
        let mine = ThreadKeys::default();
        assert_ne!(mine.hash_one("alice"), fixed.hash_one("alice"));
        // Made once per thread: every map of a thread hashes alike.
        assert_eq!(
            mine.hash_one("alice"),
            ThreadKeys::default().hash_one("alice")
        );
        let there = std::thread::spawn(|| ThreadKeys::default().hash_one("alice"));
        assert_ne!(there.join().unwrap(), mine.hash_one("alice"));
    }

    #[test]
    fn a_users_groups_are_those_the_host_said_of_their_uid() {
        let truth = HostTruth {
            groups: [(1001, vec!["alice".to_string(), "lab".to_string()])]
                .into_iter()
                .collect(),
            ..HostTruth::default()
        };
        assert_eq!(truth.groups_of(1001), ["alice", "lab"]);
        assert!(truth.groups_of(1002).is_empty(), "not said");
    }

    #[test]
    fn host_names_are_one_printable_word_that_names_no_path() {
        for good in [
            "gpu1",
            "alice@gpu1:2222",
            "[::1]:22",
            "h.example.org",
            &"x".repeat(255),
        ] {
            assert_eq!(HostId::new(good), Ok(HostId(good.into())));
        }
        for bad in [
            "",
            "-oProxyCommand=x",
            "a b",
            "gpu\u{1}",
            "gpu\n",
            "../etc/x",
            &"x".repeat(256),
        ] {
            assert!(HostId::new(bad).is_err(), "{bad:?}");
        }
    }
}
