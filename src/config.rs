//! The command line, and the host list or inventory text it names, resolved
//! into a [`Request`]: validated settings and what to open and build, with
//! no syscall and no environment read (what had to be read first comes in
//! [`Read`]). Every way the flags can be wrong is a [`ConfigError`] here,
//! before anything runs; [`crate::setup`] then does the I/O.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::cli::{
    Cli, Command, CycleArgs, HostKeyCheck, OutputFormat, RemoteArgs, RemoteCommand, RuleArgs,
};
use crate::cycle::Options;
use crate::ha::HaSpec;
use crate::host::recorded::Recorded;
use crate::host::remote::AgentLifetime;
use crate::host::ssh::{AtEnd, HostSpec, SshOptions};
use crate::inventory::{self, Inventory, InventoryError, Overrides};
use crate::model::{HostId, Mode};
use crate::notify::{mail, MailSpec, Notify, NotifyError, WebhookSpec};
use crate::report::Format;
use crate::rules::Policy;

/// How a run goes: each cycle's [`Options`], and what the loop around the
/// cycles needs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// What each cycle is told.
    pub cycle: Options,
    /// Between cycles; zero: one cycle.
    pub interval: Duration,
    pub format: Format,
    /// genv's `-q`: do not print host failures (JSON output still carries
    /// them).
    pub quiet: bool,
    /// Consecutive cycles a violation must be seen in before it is acted on.
    /// When actions are carried out: `--confirm-cycles`, `--grace` and
    /// the rules' own.
    pub grace: crate::ladder::Grace,
    /// `--state-db`, opened by [`crate::setup`]: kept across restarts.
    pub state: Option<Arc<crate::state_db::StateDb>>,
    /// `--retain`: how long the database keeps events, actions and usage.
    pub retain: Duration,
    /// Where warnings, actions and clearings are told (`--smtp`,
    /// `--webhook`), with their secrets read by [`crate::setup`]; none in a
    /// dry run.
    pub notify: Option<Arc<Notify>>,
    /// `--ha-etcd`: one of several boxes, acting only while it leads (its
    /// password read by [`crate::setup`]).
    pub ha: Option<Arc<HaSpec>>,
}

/// What had to be read before the command line could be resolved: the
/// files it names and this machine's facts (see [`crate::setup::read`]).
#[derive(Debug, Clone, Default)]
pub struct Read {
    /// The text of `--hostfile` or `--inventory`.
    pub hosts_text: Option<String>,
    /// The `<host>.json` files of `--snapshot-dir` (when no host list
    /// names them), by name.
    pub recorded: Vec<HostId>,
    /// This machine's name: its host's id, and `--ha-name`'s default.
    pub hostname: HostId,
    /// genv's state directory here (`$GENV_TMPDIR`, or genv's default).
    pub state_dir: PathBuf,
}

/// What a command line asks for, checked; nothing opened or made yet.
#[derive(Debug)]
pub enum Request {
    /// Cycles over fleets (see [`crate::service::run`]).
    Enforce(Box<Enforce>),
    /// This machine's snapshot as genv prints it.
    Snapshot(Here),
    /// `report` over a state database.
    Report(crate::cli::ReportArgs),
    /// `status`: the service's view.
    Status(crate::cli::StatusArgs),
    /// `top`: the service's views, live.
    Top(crate::cli::TopArgs),
    /// Man pages and completions written under this directory.
    Docs(PathBuf),
    /// `doctor` over these hosts (and etcd, under `--ha-etcd`).
    Doctor(Box<Doctor>),
}

/// An enforcing run: its settings, and the files and hosts setup opens.
#[derive(Debug)]
pub struct Enforce {
    /// `state`, `notify` and `ha` are left for setup to fill.
    pub settings: Settings,
    pub hosts: Hosts,
    pub notify: Option<Notifications>,
    pub ha: Option<Ha>,
    /// `--state-db`.
    pub state_db: Option<PathBuf>,
    /// `--audit-log`.
    pub audit_log: Option<PathBuf>,
    /// `--metrics-listen`.
    pub metrics: Option<std::net::SocketAddr>,
    /// `--web.config.file`: the metrics endpoint's TLS and users.
    pub web_config: Option<PathBuf>,
    /// `--view-socket`, `--view-group`.
    pub view_socket: Option<PathBuf>,
    pub view_group: Option<String>,
}

/// `doctor`, here or over SSH.
#[derive(Debug)]
pub struct Doctor {
    pub hosts: Hosts,
    pub format: Format,
    pub ha: Option<Ha>,
    /// The inventory caps devices per user (doctor says what that leaves
    /// open).
    pub device_caps: bool,
}

/// The hosts a run works on.
#[derive(Debug)]
pub enum Hosts {
    /// This machine, one fleet.
    Here(Here),
    /// `enforce --snapshot FILE...`: a fleet of one per file.
    Files(Vec<Recorded>),
    /// `remote enforce --snapshot-dir`: one fleet.
    Recorded {
        hosts: Vec<Recorded>,
        concurrency: usize,
    },
    /// Over SSH, one fleet.
    Ssh(Box<SshHosts>),
}

/// This machine, reached by running the agent as a child.
#[derive(Debug, Clone)]
pub struct Here {
    pub id: HostId,
    /// genv's state directory.
    pub state_dir: PathBuf,
    /// Each request's deadline.
    pub timeout: Duration,
    pub agent: AgentTuning,
}

/// What each host's agent is asked to say beyond genv's snapshot.
#[derive(Debug, Clone)]
pub struct AgentTuning {
    /// `--max-records`.
    pub max_records: usize,
    /// The groups whose members snapshots say (group exemptions, caps).
    pub groups: Vec<String>,
    /// How busy GPUs and processes are (the idle rule).
    pub utilization: bool,
}

impl Default for AgentTuning {
    fn default() -> Self {
        AgentTuning {
            max_records: crate::snapshot::genv::DEFAULT_MAX_RECORDS,
            groups: Vec::new(),
            utilization: false,
        }
    }
}

/// The SSH hosts of a run (a shard's, under `--shard`).
#[derive(Debug)]
pub struct SshHosts {
    pub specs: Vec<HostSpec>,
    /// `--shard`: each host's place in the whole inventory (empty: all of
    /// it).
    pub positions: HashMap<HostId, usize>,
    /// How connections are made; `control_dir` is `--control-dir`, or
    /// empty for setup to make a private temporary one.
    pub ssh: SshOptions,
    pub command_timeout: Duration,
    pub lifetime: AgentLifetime,
    pub agent: AgentTuning,
    pub concurrency: usize,
}

/// The notification channels, checked; the secrets they name are read by
/// setup.
#[derive(Debug)]
pub struct Notifications {
    /// Its webhook is `None` while it is still in `webhook_file`.
    pub notify: Notify,
    /// `--smtp-credentials`.
    pub credentials_file: Option<PathBuf>,
    /// `--webhook-file`.
    pub webhook_file: Option<PathBuf>,
}

/// `--ha-*`, checked; the password it names is read by setup.
#[derive(Debug, Clone)]
pub struct Ha {
    /// Its `user` is `None` until setup reads `login`'s password.
    pub spec: HaSpec,
    /// `--ha-user` and `--ha-password-file`.
    pub login: Option<(String, PathBuf)>,
}

/// A command line that cannot run.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("-H: {0}")]
    HostList(String),
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    #[error("{}: no hosts", path.display())]
    NoHosts { path: PathBuf },
    #[error("remote: one of -H/--host, --hostfile or --inventory is required")]
    NoHostsGiven,
    #[error("--snapshot-dir {}: no recorded snapshots (<host>.json) in it", dir.display())]
    NoSnapshots { dir: PathBuf },
    #[error(transparent)]
    Notify(#[from] NotifyError),
    #[error("--ha-etcd")]
    Ha(#[from] HaFlagError),
    #[error("`config` checks a configuration file; it runs nothing")]
    ConfigCommand,
}

/// `--ha-*` and `--shard` flags that cannot be used.
#[derive(Debug, Error)]
pub enum HaFlagError {
    #[error("a dry run (or a replay of recorded snapshots) acts on nothing: there is no leader to elect")]
    DryRun,
    #[error("--shard splits a remote fleet: it is for `remote ... enforce`")]
    LocalShard,
    #[error("{0} needs --ha-etcd")]
    NeedsEtcd(&'static str),
    #[error("{0:?} is not an etcd client URL (http://HOST:PORT, or https:// with --ha-cacert)")]
    Url(String),
    #[error("{0}: https:// URLs need --ha-cacert, and --ha-cacert needs https:// URLs")]
    Tls(String),
    #[error("--ha-key {0:?}: a prefix such as /genv-enforce")]
    Key(String),
    #[error("--ha-fence-dir {0:?}: an absolute path without '.', '..', '//' or a trailing '/'")]
    FenceDir(String),
    #[error("--ha-name {0:?}: 1 to 255 printable characters")]
    Name(String),
    #[error("--shard counts only the per-user device caps across shards: --max-devices-per-group and the memory caps would count one shard's hosts alone")]
    ShardCaps,
    #[error("--shard {k}/{n}: no host of the inventory falls in it")]
    EmptyShard { k: u32, n: u32 },
}

/// Resolves a parsed command line, with what it names already `read`.
///
/// # Errors
/// Invalid host lists and inventories, a `--snapshot-dir` that holds no
/// snapshots, flags that contradict each other or cannot be used.
pub fn resolve(cli: Cli, read: &Read) -> Result<Request, ConfigError> {
    match cli.command {
        Command::Snapshot(args) => Ok(Request::Snapshot(here(
            read,
            args.command_timeout,
            AgentTuning::default(),
        ))),
        Command::Doctor(args) => Ok(Request::Doctor(Box::new(Doctor {
            ha: ha(&args.output.ha, Duration::ZERO, read)?,
            hosts: Hosts::Here(here(read, args.command_timeout, AgentTuning::default())),
            format: format(args.output.output),
            device_caps: false,
        }))),
        Command::Enforce(args) => {
            let replay = !args.snapshot.is_empty();
            let mut settings = settings(&args.cycle, policy(&args.rules), Mode::Local, replay);
            settings.grace.rules = args.rules.graces();
            let ha = checked_ha(&settings, &args.cycle, replay, read)?;
            let hosts = if replay {
                Hosts::Files(
                    args.snapshot
                        .iter()
                        .map(|p| recorded(p.as_path()))
                        .collect(),
                )
            } else {
                let agent = tuning(&args.cycle, &settings.cycle.policy, []);
                Hosts::Here(here(read, args.command_timeout, agent))
            };
            enforce(settings, hosts, ha, &args.cycle, &BTreeMap::new())
        }
        Command::Remote(args) => remote(*args, read),
        Command::Report(args) => Ok(Request::Report(args)),
        Command::Status(args) => Ok(Request::Status(args)),
        Command::Top(args) => Ok(Request::Top(crate::cli::TopArgs {
            config: cli.config,
            ..args
        })),
        Command::Docs(args) => Ok(Request::Docs(args.out)),
        Command::Config(_) => Err(ConfigError::ConfigCommand),
    }
}

/// This machine.
fn here(read: &Read, timeout: Duration, agent: AgentTuning) -> Here {
    Here {
        id: read.hostname.clone(),
        state_dir: read.state_dir.clone(),
        timeout,
        agent,
    }
}

/// A recorded snapshot named by its file's stem.
fn recorded(path: &std::path::Path) -> Recorded {
    let id = path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    Recorded {
        id: HostId(id.into()),
        path: path.to_path_buf(),
    }
}

/// An enforcing request: `settings` with the channels and files `c` names.
fn enforce(
    settings: Settings,
    hosts: Hosts,
    ha: Option<Ha>,
    c: &CycleArgs,
    users: &BTreeMap<String, String>,
) -> Result<Request, ConfigError> {
    Ok(Request::Enforce(Box::new(Enforce {
        notify: notifications(c, users)?,
        settings,
        hosts,
        ha,
        state_db: c.state_db.clone(),
        audit_log: c.audit_log.clone(),
        metrics: c.metrics_listen,
        web_config: c.web_config_file.clone(),
        view_socket: c.view_socket.clone(),
        view_group: c.view_group.clone(),
    })))
}

fn remote(args: RemoteArgs, read: &Read) -> Result<Request, ConfigError> {
    let enforce_args = match &args.command {
        RemoteCommand::Enforce(enforce) => enforce,
        RemoteCommand::Doctor(d) => {
            let ha = ha(&d.ha, Duration::ZERO, read)?;
            let inventory = hosts(&args, read)?;
            let device_caps = inventory.as_ref().is_some_and(|i| {
                i.caps.max_devices_per_user.is_some() || !i.caps.max_devices_for_user.is_empty()
            });
            let agent = AgentTuning {
                groups: exempt_groups(inventory.as_ref()),
                ..AgentTuning::default()
            };
            let ssh = ssh_hosts(
                &args,
                inventory,
                AgentLifetime::OneCycle,
                Duration::ZERO,
                agent,
            )?;
            return Ok(Request::Doctor(Box::new(Doctor {
                hosts: Hosts::Ssh(Box::new(ssh)),
                format: format(d.output),
                ha,
                device_caps,
            })));
        }
    };
    let inventory = hosts(&args, read)?;
    let mut policy = policy(&enforce_args.rules);
    if let Some(inv) = &inventory {
        // Flags win over the inventory's caps.
        policy.max_devices_per_user = policy
            .max_devices_per_user
            .or(inv.caps.max_devices_per_user);
        let mut caps = inv.caps.max_devices_for_user.clone();
        caps.extend(policy.max_devices_for_user);
        policy.max_devices_for_user = caps;
    }
    let c = &enforce_args.cycle;
    let replay = enforce_args.snapshot_dir.is_some();
    let mut settings = settings(c, policy, Mode::Remote, replay);
    settings.cycle.exit_on_error = args.exit_on_error;
    settings.quiet = args.quiet;
    let emails = inventory
        .as_ref()
        .map(|i| i.emails.clone())
        .unwrap_or_default();
    settings.grace.rules = enforce_args.rules.graces();
    if let Some(inv) = &inventory {
        // The inventory's [policy.<rule>] wins over a flag's grace.
        settings.grace.rules.extend(inv.policy.clone());
        settings.grace.exempt = inv.exempt.clone();
    }
    let ha = checked_ha(&settings, c, replay, read)?;
    if let Some(dir) = &enforce_args.snapshot_dir {
        let ids = match inventory {
            Some(i) => i.hosts.into_iter().map(|h| h.id).collect(),
            None if read.recorded.is_empty() => {
                return Err(ConfigError::NoSnapshots { dir: dir.clone() })
            }
            None => read.recorded.clone(),
        };
        let hosts = ids
            .into_iter()
            .map(|id| Recorded {
                path: dir.join(format!("{id}.json")),
                id,
            })
            .collect();
        let hosts = Hosts::Recorded {
            hosts,
            concurrency: usize::from(args.concurrency),
        };
        return enforce(settings, hosts, ha, c, &emails);
    }
    let lifetime = if settings.interval.is_zero() {
        AgentLifetime::OneCycle
    } else {
        AgentLifetime::Kept
    };
    let agent = tuning(c, &settings.cycle.policy, exempt_groups(inventory.as_ref()));
    let mut ssh = ssh_hosts(&args, inventory, lifetime, settings.interval, agent)?;
    sharded(&mut ssh, &settings, ha.as_ref())?;
    enforce(settings, Hosts::Ssh(Box::new(ssh)), ha, c, &emails)
}

/// What agents say for `policy`: the members of `groups` and of the
/// capped groups, and utilization for the idle rule.
fn tuning(c: &CycleArgs, policy: &Policy, groups: impl IntoIterator<Item = String>) -> AgentTuning {
    AgentTuning {
        max_records: c.max_records,
        groups: groups
            .into_iter()
            .chain(policy.max_devices_per_group.keys().cloned())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect(),
        utilization: policy.idle.is_some(),
    }
}

/// The groups the inventory exempts (their members must be said).
fn exempt_groups(inventory: Option<&Inventory>) -> Vec<String> {
    inventory
        .iter()
        .flat_map(|i| i.exempt.iter().filter_map(|e| e.group.clone()))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// The SSH hosts of `inventory` (one of -H, --hostfile, --inventory is
/// required).
fn ssh_hosts(
    args: &RemoteArgs,
    inventory: Option<Inventory>,
    lifetime: AgentLifetime,
    interval: Duration,
    agent: AgentTuning,
) -> Result<SshHosts, ConfigError> {
    let inventory = inventory.ok_or(ConfigError::NoHostsGiven)?;
    let specs = inventory
        .hosts
        .into_iter()
        .map(|mut h| {
            h.identity_file = h.identity_file.or_else(|| args.identity_file.clone());
            h
        })
        .collect();
    let ssh = SshOptions {
        connect_timeout: args.timeout.map(Duration::from_secs),
        control_dir: args.control_dir.clone().unwrap_or_default(),
        // Masters left by a crash exit on their own once idle this long.
        persist: args
            .control_persist
            .unwrap_or((interval * 3).max(Duration::from_secs(60))),
        at_end: if args.control_persist.is_some() {
            AtEnd::Persist
        } else {
            AtEnd::Close
        },
        known_hosts: match args.host_key_check {
            HostKeyCheck::Strict => openssh::KnownHosts::Strict,
            HostKeyCheck::AcceptNew => openssh::KnownHosts::Add,
        },
        known_hosts_file: args.known_hosts_file.clone(),
    };
    Ok(SshHosts {
        specs,
        positions: HashMap::new(),
        ssh,
        command_timeout: args.command_timeout,
        lifetime,
        agent,
        concurrency: usize::from(args.concurrency),
    })
}

/// The policy the rule flags ask for, genv's defaults elsewhere.
pub fn policy(r: &RuleArgs) -> Policy {
    let d = Policy::default();
    let pick = |on: bool, off: bool, default: bool| {
        if on {
            true
        } else if off {
            false
        } else {
            default
        }
    };
    Policy {
        non_env_processes: pick(
            r.non_env_processes,
            r.no_non_env_processes,
            d.non_env_processes,
        ),
        env_devices: pick(r.env_devices, r.no_env_devices, d.env_devices),
        env_memory: pick(r.env_memory, r.no_env_memory, d.env_memory),
        max_devices_per_user: r.max_devices_per_user,
        max_devices_for_user: r.max_devices_for_user.iter().cloned().collect(),
        max_memory_per_user: r.max_memory_per_user,
        max_memory_for_user: r.max_memory_for_user.iter().cloned().collect(),
        max_devices_per_group: r.max_devices_per_group.iter().cloned().collect(),
        idle: r.idle_after.map(|after| crate::rules::idle::IdlePolicy {
            after,
            below: r.idle_below,
        }),
        orphans_as_non_env: r.orphans_as_non_env.is_some(),
        count_non_env_devices: r.count_non_env_devices,
    }
}

/// Cycle settings from the flags; a replay of recorded snapshots is always
/// a single dry run.
fn settings(c: &CycleArgs, policy: Policy, mode: Mode, replay: bool) -> Settings {
    // A few intervals (and a slow cycle) between sightings still count as
    // consecutive; a cron run's sightings always do.
    let gap = (!c.interval.is_zero()).then(|| c.interval * 3 + Duration::from_secs(60));
    Settings {
        cycle: Options {
            mode,
            policy,
            dry_run: c.dry_run || replay,
            follows: false,
            exit_on_error: false,
            kill_after: c.kill_after,
            // Only a run that keeps or serves them samples usage.
            sample_usage: c.state_db.is_some() || c.metrics_listen.is_some(),
            idle_gap: gap.unwrap_or(crate::state_db::MAX_SAMPLE_GAP),
            view: false,
        },
        interval: if replay { Duration::ZERO } else { c.interval },
        format: format(c.output),
        quiet: false,
        grace: crate::ladder::Grace {
            cycles: c.confirm_cycles,
            after: c.grace,
            rules: Default::default(),
            exempt: Vec::new(),
            gap,
        },
        state: None,
        retain: c.retain,
        notify: None,
        ha: None,
    }
}

/// `--ha-*` resolved for `settings`; a dry run or a replay elects nobody.
fn checked_ha(
    settings: &Settings,
    c: &CycleArgs,
    replay: bool,
    read: &Read,
) -> Result<Option<Ha>, ConfigError> {
    let ha = ha(&c.ha, settings.interval, read)?;
    if ha.is_some() && (replay || settings.cycle.dry_run) {
        return Err(HaFlagError::DryRun.into());
    }
    if settings.cycle.mode == Mode::Local && ha.as_ref().is_some_and(|h| h.spec.shard.is_some()) {
        return Err(HaFlagError::LocalShard.into());
    }
    Ok(ha)
}

/// `--ha-*` checked: URLs, the fence directory, the name, TLS.
fn ha(a: &crate::cli::HaArgs, interval: Duration, read: &Read) -> Result<Option<Ha>, ConfigError> {
    use crate::ha::TlsSpec;
    let bad = |e: HaFlagError| Err(e.into());
    if a.ha_etcd.is_empty() {
        let stray = [
            (a.ha_name.is_some(), "--ha-name"),
            (a.ha_ttl.is_some(), "--ha-ttl"),
            (a.ha_cacert.is_some(), "--ha-cacert"),
            (a.ha_user.is_some(), "--ha-user"),
            (a.ha_key != crate::ha::DEFAULT_KEY, "--ha-key"),
            (a.ha_fence_dir != crate::ha::FENCE_DIR, "--ha-fence-dir"),
            (a.shard.is_some(), "--shard"),
        ];
        if let Some((_, flag)) = stray.iter().find(|(set, _)| *set) {
            return bad(HaFlagError::NeedsEtcd(flag));
        }
        return Ok(None);
    }
    for url in &a.ha_etcd {
        let tls = url.starts_with("https://");
        if !(tls || url.starts_with("http://")) || url.len() < 10 {
            return bad(HaFlagError::Url(url.clone()));
        }
        if tls != a.ha_cacert.is_some() {
            return bad(HaFlagError::Tls(url.clone()));
        }
    }
    if !a.ha_key.starts_with('/')
        || a.ha_key.len() < 2
        || a.ha_key.ends_with('/')
        || a.ha_key.chars().any(char::is_control)
    {
        return bad(HaFlagError::Key(a.ha_key.clone()));
    }
    let dir = &a.ha_fence_dir;
    // Each part named once: the agent opens the last without following a
    // link, so a trailing '/', '.' or '..' would let one be followed.
    let parts: Vec<&str> = dir.split('/').skip(1).collect();
    if !dir.starts_with('/')
        || parts
            .iter()
            .any(|p| p.is_empty() || *p == "." || *p == "..")
        || dir.chars().any(char::is_control)
    {
        return bad(HaFlagError::FenceDir(dir.clone()));
    }
    let name = match &a.ha_name {
        Some(n) if !n.is_empty() && !n.chars().any(char::is_control) && n.len() <= 255 => n.clone(),
        Some(n) => return bad(HaFlagError::Name(n.clone())),
        None => read.hostname.0.to_string(),
    };
    Ok(Some(Ha {
        spec: HaSpec {
            endpoints: a.ha_etcd.clone(),
            key: a.ha_key.clone(),
            name,
            ttl: a.ha_ttl.unwrap_or_else(|| crate::ha::default_ttl(interval)),
            fence_dir: dir.clone(),
            tls: a.ha_cacert.as_ref().map(|ca| TlsSpec {
                ca: ca.clone(),
                identity: a.ha_cert.clone().zip(a.ha_cert_key.clone()),
            }),
            user: None,
            shard: a.shard,
            config: String::new(),
        },
        login: a.ha_user.clone().zip(a.ha_password_file.clone()),
    }))
}

/// `hosts` cut to `ha`'s shard (`--shard K/N`): its hosts at places K,
/// K+N, ... of the inventory, each with its place. Only the per-user
/// device caps count across shards: the other caps are refused.
fn sharded(hosts: &mut SshHosts, settings: &Settings, ha: Option<&Ha>) -> Result<(), ConfigError> {
    let Some(shard) = ha.and_then(|h| h.spec.shard) else {
        return Ok(());
    };
    let p = &settings.cycle.policy;
    if !p.max_devices_per_group.is_empty() || p.has_memory_caps() {
        return Err(HaFlagError::ShardCaps.into());
    }
    let specs = std::mem::take(&mut hosts.specs);
    for (position, spec) in specs.into_iter().enumerate() {
        if shard.holds(position) {
            hosts.positions.insert(spec.id.clone(), position);
            hosts.specs.push(spec);
        }
    }
    if hosts.specs.is_empty() {
        return Err(HaFlagError::EmptyShard {
            k: shard.k,
            n: shard.n,
        }
        .into());
    }
    Ok(())
}

/// The notification channels of the flags, each checked (addresses, the
/// mail template); `users`: the inventory's addresses. `None`: no channel.
fn notifications(
    c: &CycleArgs,
    users: &BTreeMap<String, String>,
) -> Result<Option<Notifications>, ConfigError> {
    let mail = match &c.smtp {
        None => {
            let stray = [
                (c.smtp_credentials.is_some(), "--smtp-credentials"),
                (c.mail_from.is_some(), "--mail-from"),
                (c.mail_to.is_some(), "--mail-to"),
                (!c.mail_admin.is_empty(), "--mail-admin"),
            ];
            if let Some((_, flag)) = stray.iter().find(|(given, _)| *given) {
                return Err(NotifyError::NoSmtp(flag).into());
            }
            None
        }
        Some(url) => {
            let from = c.mail_from.as_deref().ok_or(NotifyError::NoSender)?;
            if let Some(t) = &c.mail_to {
                if !t.contains("{user}") {
                    return Err(NotifyError::MailTo(t.clone()).into());
                }
                mail::mailbox("--mail-to", &t.replace("{user}", "user"))?;
            }
            for (name, a) in users {
                if let Err(why) = a.parse::<lettre::message::Mailbox>() {
                    return Err(NotifyError::Address {
                        flag: "[users] email",
                        value: format!("{a} (user {name})"),
                        why,
                    }
                    .into());
                }
            }
            Some(MailSpec {
                url: url.clone(),
                credentials: None,
                from: mail::mailbox("--mail-from", from)?,
                to: c.mail_to.clone(),
                users: users.clone(),
                admins: c
                    .mail_admin
                    .iter()
                    .map(|a| mail::mailbox("--mail-admin", a))
                    .collect::<Result<_, _>>()?,
            })
        }
    };
    let webhook = c.webhook.clone().map(WebhookSpec::new);
    let webhook_file = if webhook.is_none() {
        c.webhook_file.clone()
    } else {
        None
    };
    let notify = Notify {
        mail,
        webhook,
        terminal: c.notify_terminal,
        per_user_hour: c.notify_rate,
        link: c.notify_link.clone(),
    };
    Ok(
        (notify.any() || webhook_file.is_some()).then(|| Notifications {
            notify,
            credentials_file: c.smtp_credentials.clone(),
            webhook_file,
        }),
    )
}

fn format(f: OutputFormat) -> Format {
    match f {
        OutputFormat::Text => Format::Text,
        OutputFormat::Json => Format::Json,
    }
}

/// The hosts named by -H, or by the text of --hostfile or --inventory
/// (`read.hosts_text`), if any.
fn hosts(args: &RemoteArgs, read: &Read) -> Result<Option<Inventory>, ConfigError> {
    let overrides = Overrides {
        user: args.username.clone(),
    };
    let text = read.hosts_text.as_deref().unwrap_or_default();
    if let Some(list) = &args.host {
        let hosts = inventory::parse_host_list(list, &overrides).map_err(ConfigError::HostList)?;
        return Ok(Some(Inventory {
            hosts,
            ..Inventory::default()
        }));
    }
    if let Some(path) = &args.hostfile {
        let hosts = inventory::parse_hostfile(text, &path.display().to_string(), &overrides)?;
        if hosts.is_empty() {
            return Err(ConfigError::NoHosts { path: path.clone() });
        }
        return Ok(Some(Inventory {
            hosts,
            ..Inventory::default()
        }));
    }
    if let Some(path) = &args.inventory {
        return Ok(Some(inventory::parse_inventory(
            text,
            &path.display().to_string(),
            &overrides,
        )?));
    }
    Ok(None)
}

/// The file of hosts `args` names (`--hostfile` or `--inventory`), read by
/// setup before [`resolve`]; none for `-H`.
pub fn hosts_file(args: &RemoteArgs) -> Option<&std::path::Path> {
    if args.host.is_some() {
        return None;
    }
    args.hostfile.as_deref().or(args.inventory.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// What setup would have read: a machine called `here`.
    fn read() -> Read {
        Read {
            hostname: HostId("here".into()),
            state_dir: PathBuf::from("/var/tmp/genv"),
            ..Read::default()
        }
    }

    /// `enforce <args>`'s cycle flags.
    fn cycle(args: &[&str]) -> CycleArgs {
        let cli = Cli::try_parse_from(["genv-enforce", "enforce"].iter().chain(args))
            .unwrap_or_else(|e| panic!("{e}"));
        match cli.command {
            Command::Enforce(e) => e.cycle,
            _ => unreachable!(),
        }
    }

    fn ha(args: &[&str]) -> Result<Option<crate::ha::HaSpec>, String> {
        super::ha(&cycle(args).ha, Duration::from_secs(10), &read())
            .map(|h| h.map(|h| h.spec))
            .map_err(|e| crate::error::chain(&e))
    }

    #[test]
    fn ha_flags_are_checked_and_given_their_defaults() {
        assert_eq!(ha(&[]), Ok(None));
        let spec = ha(&["--ha-etcd", "http://10.0.0.1:2379,http://10.0.0.2:2379"])
            .unwrap()
            .unwrap();
        assert_eq!(spec.endpoints.len(), 2);
        assert_eq!(spec.key, crate::ha::DEFAULT_KEY);
        assert_eq!(spec.name, "here");
        assert_eq!(spec.ttl, Duration::from_secs(30));
        assert_eq!(spec.fence_dir, crate::ha::FENCE_DIR);
        assert_eq!((spec.tls, spec.user, spec.shard), (None, None, None));
        let spec = ha(&[
            "--ha-etcd",
            "http://e:2379",
            "--ha-name",
            "box-a",
            "--ha-ttl",
            "6s",
            "--ha-key",
            "/lab",
            "--shard",
            "2/3",
            "--ha-fence-dir",
            "/run/x",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                spec.name.as_str(),
                spec.ttl,
                spec.key.as_str(),
                spec.fence_dir.as_str()
            ),
            ("box-a", Duration::from_secs(6), "/lab", "/run/x")
        );
        assert_eq!(spec.shard, Some(crate::ha::Shard { k: 2, n: 3 }));
        for (args, why) in [
            (&["--ha-name", "a"][..], "--ha-name needs --ha-etcd"),
            (&["--shard", "1/2"], "--shard needs --ha-etcd"),
            (&["--ha-etcd", "etcd:2379"], "is not an etcd client URL"),
            (&["--ha-etcd", "https://e:2379"], "need --ha-cacert"),
            (
                &["--ha-etcd", "http://e:2379", "--ha-cacert", "/ca"],
                "need --ha-cacert",
            ),
            (
                &["--ha-etcd", "http://e:2379", "--ha-key", "lab"],
                "a prefix such as",
            ),
            (
                &["--ha-etcd", "http://e:2379", "--ha-key", "/lab/"],
                "a prefix such as",
            ),
            (
                &["--ha-etcd", "http://e:2379", "--ha-fence-dir", "run/x"],
                "an absolute path",
            ),
            (
                &[
                    "--ha-etcd",
                    "http://e:2379",
                    "--ha-fence-dir",
                    "/run/../tmp",
                ],
                "an absolute path",
            ),
            (
                &["--ha-etcd", "http://e:2379", "--ha-fence-dir", "/run/x/"][..],
                "an absolute path",
            ),
            (
                &["--ha-etcd", "http://e:2379", "--ha-fence-dir", "/run//x"][..],
                "an absolute path",
            ),
            (
                &["--ha-etcd", "http://e:2379", "--ha-fence-dir", "/run/./x"][..],
                "an absolute path",
            ),
            (
                &["--ha-etcd", "http://e:2379", "--ha-fence-dir", "/"][..],
                "an absolute path",
            ),
            (
                &["--ha-etcd", "http://e:2379", "--ha-name", "a\u{1b}b"],
                "printable",
            ),
        ] {
            let e = ha(args).unwrap_err();
            assert!(e.contains(why), "{args:?}: {e}");
        }
    }

    #[test]
    fn the_etcd_login_is_left_for_setup_to_read() {
        let args = [
            "--ha-etcd",
            "http://e:2379",
            "--ha-user",
            "enf",
            "--ha-password-file",
            "/etc/pw",
        ];
        let h = super::ha(&cycle(&args).ha, Duration::ZERO, &read())
            .unwrap()
            .unwrap();
        assert_eq!(h.login, Some(("enf".into(), PathBuf::from("/etc/pw"))));
        assert_eq!(h.spec.user, None);
    }

    fn ha_with(args: &[&str], mode: Mode) -> Result<Option<Ha>, String> {
        let c = cycle(args);
        let policy = crate::rules::Policy::default();
        checked_ha(&settings(&c, policy, mode, false), &c, false, &read())
            .map_err(|e| crate::error::chain(&e))
    }

    #[test]
    fn a_dry_run_elects_nobody_and_shards_split_remote_fleets_only() {
        let etcd = ["--ha-etcd", "http://e:2379"];
        assert!(ha_with(&etcd, Mode::Remote).unwrap().is_some());
        let dry = [&etcd[..], &["--dry-run"]].concat();
        assert!(ha_with(&dry, Mode::Remote)
            .unwrap_err()
            .contains("a dry run"));
        let c = cycle(&etcd);
        let s = settings(&c, Default::default(), Mode::Remote, true);
        assert!(checked_ha(&s, &c, true, &read()).is_err(), "a replay");
        let shard = [&etcd[..], &["--shard", "1/2"]].concat();
        assert!(ha_with(&shard, Mode::Local).unwrap_err().contains("remote"));
        assert!(ha_with(&shard, Mode::Remote).is_ok());
    }

    /// `remote -H h1,...,hN enforce <args>` resolved.
    fn remote_hosts(n: usize, args: &[&str]) -> Result<SshHosts, String> {
        let list = (1..=n)
            .map(|i| format!("h{i}"))
            .collect::<Vec<_>>()
            .join(",");
        let cli = Cli::try_parse_from(
            ["genv-enforce", "remote", "-H", &list, "enforce"]
                .iter()
                .chain(args),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        match resolve(cli, &read()).map_err(|e| crate::error::chain(&e))? {
            Request::Enforce(e) => match e.hosts {
                Hosts::Ssh(s) => Ok(*s),
                h => panic!("{h:?}"),
            },
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn a_shard_keeps_every_nth_host_with_its_place_and_refuses_caps_it_cannot_count() {
        let args = ["--ha-etcd", "http://e:2379", "--shard", "2/3"];
        let s = remote_hosts(7, &args).unwrap();
        let ids: Vec<&str> = s.specs.iter().map(|h| &*h.id.0).collect();
        assert_eq!(ids, ["h2", "h5"]);
        let mut places: Vec<(String, usize)> = s
            .positions
            .iter()
            .map(|(h, p)| (h.0.to_string(), *p))
            .collect();
        places.sort();
        assert_eq!(places, [("h2".into(), 1), ("h5".into(), 4)]);
        // Unsharded: the fleet as it was, no places.
        let s = remote_hosts(3, &["--ha-etcd", "http://e:2379"]).unwrap();
        assert_eq!((s.specs.len(), s.positions.len()), (3, 0));
        let e = remote_hosts(1, &args).unwrap_err();
        assert!(e.contains("no host of the inventory falls in it"), "{e}");
        let grouped = [&args[..], &["--max-devices-per-group", "lab=2"]].concat();
        assert!(remote_hosts(3, &grouped)
            .unwrap_err()
            .contains("--max-devices-per-group"));
        let memory = [&args[..], &["--max-memory-per-user", "1g"]].concat();
        assert!(remote_hosts(3, &memory).is_err());
    }

    #[test]
    fn resolving_reads_nothing_it_was_not_given() {
        // The hosts' text, the recorded snapshots' names and this
        // machine's facts all come in `Read`.
        let cli = Cli::try_parse_from([
            "genv-enforce",
            "remote",
            "--inventory",
            "/nonexistent/hosts.toml",
            "enforce",
            "--state-db",
            "/nonexistent/state.db",
            "--audit-log",
            "/nonexistent/audit.log",
        ])
        .unwrap();
        let r = Read {
            hosts_text: Some(
                "[[host]]\nname = \"gpu1\"\n[[host]]\nname = \"gpu2\"\naddress = \"10.0.0.2\"\n"
                    .into(),
            ),
            ..read()
        };
        let Request::Enforce(e) = resolve(cli, &r).unwrap() else {
            panic!("not enforcing")
        };
        let Hosts::Ssh(s) = &e.hosts else {
            panic!("{:?}", e.hosts)
        };
        let ids: Vec<&str> = s.specs.iter().map(|h| &*h.id.0).collect();
        assert_eq!(ids, ["gpu1", "gpu2"]);
        assert!(s.ssh.control_dir.as_os_str().is_empty(), "made by setup");
        assert_eq!(e.state_db, Some(PathBuf::from("/nonexistent/state.db")));
        let cli =
            Cli::try_parse_from(["genv-enforce", "remote", "enforce", "--snapshot-dir", "/d"])
                .unwrap();
        let e = crate::error::chain(&resolve(cli, &read()).unwrap_err());
        assert!(e.contains("no recorded snapshots"), "{e}");
        let cli = Cli::try_parse_from(["genv-enforce", "enforce"]).unwrap();
        let Request::Enforce(e) = resolve(cli, &read()).unwrap() else {
            panic!("not enforcing")
        };
        let Hosts::Here(h) = &e.hosts else {
            panic!("{:?}", e.hosts)
        };
        assert_eq!(
            (&*h.id.0, h.state_dir.to_str()),
            ("here", Some("/var/tmp/genv"))
        );
    }

    /// `remote --inventory I <command...>` resolved with `text` as I.
    fn with_inventory(text: &str, command: &[&str]) -> Request {
        let cli = Cli::try_parse_from(
            ["genv-enforce", "remote", "--inventory", "/i.toml"]
                .iter()
                .chain(command),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let r = Read {
            hosts_text: Some(text.into()),
            ..read()
        };
        resolve(cli, &r).unwrap_or_else(|e| panic!("{}", crate::error::chain(&e)))
    }

    #[test]
    fn agents_are_asked_for_the_groups_the_rules_name_and_for_utilization_when_idle_counts() {
        let inventory = "[[host]]\nname = \"a\"\n[[exempt]]\ngroup = \"vision\"\nreason = \"r\"\n";
        let Request::Enforce(e) = with_inventory(
            inventory,
            &[
                "enforce",
                "--max-devices-per-group",
                "lab=2",
                "--idle-after",
                "1h",
                "--max-records",
                "50",
            ],
        ) else {
            panic!("not enforcing")
        };
        let Hosts::Ssh(s) = e.hosts else {
            panic!("not over SSH")
        };
        assert_eq!(s.agent.groups, ["lab", "vision"]);
        assert!(s.agent.utilization);
        assert_eq!(s.agent.max_records, 50);
        let Request::Enforce(e) = with_inventory("[[host]]\nname = \"a\"\n", &["enforce"]) else {
            panic!("not enforcing")
        };
        let Hosts::Ssh(s) = e.hosts else {
            panic!("not over SSH")
        };
        assert!(s.agent.groups.is_empty() && !s.agent.utilization);
        // doctor: the exempt groups' members too.
        let Request::Doctor(d) = with_inventory(inventory, &["doctor"]) else {
            panic!("not doctor")
        };
        let Hosts::Ssh(s) = d.hosts else {
            panic!("not over SSH")
        };
        assert_eq!(s.agent.groups, ["vision"]);
    }

    #[test]
    fn a_snapshot_dir_replays_the_files_setup_found_there() {
        let cli =
            Cli::try_parse_from(["genv-enforce", "remote", "enforce", "--snapshot-dir", "/d"])
                .unwrap();
        let r = Read {
            recorded: vec![HostId("a".into()), HostId("b".into())],
            ..read()
        };
        let Request::Enforce(e) = resolve(cli, &r).unwrap() else {
            panic!("not enforcing")
        };
        let Hosts::Recorded { hosts, .. } = e.hosts else {
            panic!("not a replay")
        };
        let files: Vec<_> = hosts.iter().map(|h| h.path.to_str().unwrap()).collect();
        assert_eq!(files, ["/d/a.json", "/d/b.json"]);
        assert!(e.settings.cycle.dry_run);
    }

    #[test]
    fn notifications_are_resolved_when_a_channel_is_named_and_their_secrets_left_to_setup() {
        let c = cycle(&[]);
        assert!(notifications(&c, &BTreeMap::new()).unwrap().is_none());
        let c = cycle(&["--webhook-file", "/etc/hook"]);
        let n = notifications(&c, &BTreeMap::new()).unwrap().unwrap();
        assert_eq!(n.webhook_file, Some(PathBuf::from("/etc/hook")));
        assert!(n.notify.webhook.is_none(), "read by setup");
        let c = cycle(&["--webhook", "http://127.0.0.1:9/x"]);
        let n = notifications(&c, &BTreeMap::new()).unwrap().unwrap();
        assert_eq!(
            n.notify.webhook.map(|w| w.url).as_deref(),
            Some("http://127.0.0.1:9/x")
        );
        assert_eq!(n.webhook_file, None);
        let c = cycle(&[
            "--smtp",
            "smtp://127.0.0.1:25",
            "--mail-from",
            "enforcer@lab.example",
            "--smtp-credentials",
            "/etc/cred",
        ]);
        let n = notifications(&c, &BTreeMap::new()).unwrap().unwrap();
        assert!(n.notify.mail.is_some_and(|m| m.credentials.is_none()));
        assert_eq!(n.credentials_file, Some(PathBuf::from("/etc/cred")));
    }

    #[test]
    fn the_hosts_file_to_read_is_the_hostfile_or_the_inventory_never_for_a_host_list() {
        let remote = |args: &[&str]| {
            let cli = Cli::try_parse_from(
                ["genv-enforce", "remote"]
                    .iter()
                    .chain(args)
                    .chain(&["enforce"]),
            )
            .unwrap();
            match cli.command {
                Command::Remote(r) => r,
                _ => unreachable!(),
            }
        };
        assert_eq!(hosts_file(&remote(&["-H", "a"])), None);
        let r = remote(&["--hostfile", "/h"]);
        assert_eq!(hosts_file(&r), Some(std::path::Path::new("/h")));
        let r = remote(&["--inventory", "/i.toml"]);
        assert_eq!(hosts_file(&r), Some(std::path::Path::new("/i.toml")));
    }
}
