//! The command line (and the inventory it names) resolved into a job: the
//! hosts, as [`Fleet`]s, and how cycles run. Every way the flags can be
//! wrong is a [`ConfigError`] here, before anything runs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::audit::{AuditError, AuditLog};
use crate::cli::{
    Cli, Command, CycleArgs, HostKeyCheck, OutputFormat, RemoteArgs, RemoteCommand, RuleArgs,
};
use crate::cycle::Options;
use crate::fleet::Fleet;
use crate::host::recorded::Recorded;
use crate::host::remote::AgentLifetime;
use crate::host::ssh::{AtEnd, SshOptions};
use crate::host::Host;
use crate::host::LiveHost;
use crate::inventory::{self, Inventory, InventoryError, Overrides};
use crate::model::{HostId, Mode};
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
    /// `--state-db`: kept across restarts.
    pub state: Option<Arc<crate::state_db::StateDb>>,
    /// `--retain`: how long the database keeps events, actions and usage.
    pub retain: Duration,
    /// Where warnings, actions and clearings are told (`--smtp`,
    /// `--webhook`); none in a dry run.
    pub notify: Option<Arc<crate::notify::Notify>>,
    /// `--ha-etcd`: one of several boxes, acting only while it leads.
    pub ha: Option<Arc<crate::ha::HaSpec>>,
}

/// What a command line asks for.
// One per run (and per reload): its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Job {
    /// Cycles over fleets (see [`crate::service::run`]).
    Enforce {
        fleets: Vec<Fleet>,
        settings: Settings,
        /// The temporary directory of the SSH sockets, removed when dropped.
        control_dir: Option<tempfile::TempDir>,
        /// `--metrics-listen`.
        metrics: Option<std::net::SocketAddr>,
        /// `--web.config.file`: the metrics endpoint's TLS and users.
        web: Option<crate::web_config::WebConfig>,
    },
    /// This machine's snapshot as genv prints it.
    Snapshot(Box<LiveHost>),
    /// `report` over a state database.
    Report(crate::cli::ReportArgs),
    /// Man pages and completions written under this directory.
    Docs(PathBuf),
    /// `doctor` over these hosts (and etcd, under `--ha-etcd`).
    Doctor {
        fleet: Fleet,
        format: Format,
        control_dir: Option<tempfile::TempDir>,
        ha: Option<crate::ha::HaSpec>,
        /// The inventory caps devices per user (doctor says what that
        /// leaves open).
        device_caps: bool,
    },
}

/// A command line that cannot run.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("{}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("-H: {0}")]
    HostList(String),
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    #[error(transparent)]
    StateDb(#[from] crate::state_db::StateDbError),
    #[error("{}: no hosts", path.display())]
    NoHosts { path: PathBuf },
    #[error("remote: one of -H/--host, --hostfile or --inventory is required")]
    NoHostsGiven,
    #[error("--snapshot-dir {}", dir.display())]
    SnapshotDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--snapshot-dir {}: no recorded snapshots (<host>.json) in it", dir.display())]
    NoSnapshots { dir: PathBuf },
    /// The SSH control directory: another user could replace our sockets.
    #[error("--control-dir {}", dir.display())]
    ControlDir {
        dir: PathBuf,
        #[source]
        source: crate::private::Refusal,
    },
    #[error("cannot create a directory for SSH sockets")]
    TempDir(#[source] std::io::Error),
    #[error(transparent)]
    Audit(#[from] AuditError),
    #[error(transparent)]
    Notify(#[from] crate::notify::NotifyError),
    #[error("--ha-etcd")]
    Ha(#[from] HaFlagError),
    #[error(transparent)]
    Web(#[from] crate::web_config::WebConfigError),
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
    #[error("--ha-password-file {}", path.display())]
    PasswordFile {
        path: PathBuf,
        #[source]
        source: crate::private::Refusal,
    },
    #[error("--ha-password-file {}: empty", .0.display())]
    EmptyPassword(PathBuf),
    #[error("--ha-name {0:?}: 1 to 255 printable characters")]
    Name(String),
    #[error("--shard counts only the per-user device caps across shards: --max-devices-per-group and the memory caps would count one shard's hosts alone")]
    ShardCaps,
    #[error("--shard {k}/{n}: no host of the inventory falls in it")]
    EmptyShard { k: u32, n: u32 },
}

/// Resolves a parsed command line.
///
/// # Errors
/// Unreadable or invalid host lists and inventories, a `--snapshot-dir`
/// that holds no snapshots, an unsafe `--control-dir`.
pub fn resolve(cli: Cli) -> Result<Job, ConfigError> {
    match cli.command {
        Command::Snapshot(args) => Ok(Job::Snapshot(Box::new(LiveHost::this_machine(
            args.command_timeout,
        )))),
        Command::Doctor(args) => {
            let ha = ha_spec(&args.output.ha, Duration::ZERO)?;
            let mut fleet = Fleet::new(
                vec![Host::Live(Box::new(LiveHost::this_machine(
                    args.command_timeout,
                )))],
                1,
            );
            fleet.set_fencing(&fencing(ha.as_ref()));
            Ok(Job::Doctor {
                fleet,
                format: format(args.output.output),
                control_dir: None,
                ha,
                device_caps: false,
            })
        }
        Command::Enforce(args) => {
            let replay = !args.snapshot.is_empty();
            let mut settings = settings(&args.cycle, policy(&args.rules), Mode::Local, replay);
            settings.grace.rules = args.rules.graces();
            let settings = with_ha(settings, &args.cycle, replay)?;
            let fleets = if replay {
                args.snapshot
                    .iter()
                    .map(|path| Fleet::new(vec![Host::Recorded(recorded(path))], 1))
                    .collect()
            } else {
                let mut host = LiveHost::this_machine(args.command_timeout);
                host.agent.max_records = args.cycle.max_records;
                host.agent.groups = settings
                    .cycle
                    .policy
                    .max_devices_per_group
                    .keys()
                    .cloned()
                    .collect();
                host.agent.utilization = settings.cycle.policy.idle.is_some();
                // One fence for the fleet and its host: the election sets
                // the fleet's, the host's requests carry it.
                let mut fleet = Fleet::new(vec![Host::Live(Box::new(host))], 1);
                fleet.set_fencing(&fencing(settings.ha.as_deref()));
                vec![fleet]
            };
            Ok(Job::Enforce {
                metrics: args.cycle.metrics_listen,
                web: web(&args.cycle)?,
                fleets: with_audit(fleets, &args.cycle)?,
                settings: with_notify(
                    with_state(settings, &args.cycle)?,
                    &args.cycle,
                    &Default::default(),
                )?,
                control_dir: None,
            })
        }
        Command::Remote(args) => remote(*args),
        Command::Report(args) => Ok(Job::Report(args)),
        Command::Docs(args) => Ok(Job::Docs(args.out)),
    }
}

/// A recorded snapshot named by its file's stem.
fn recorded(path: &Path) -> Recorded {
    let id = path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    Recorded {
        id: HostId(id),
        path: path.to_path_buf(),
    }
}

fn remote(args: RemoteArgs) -> Result<Job, ConfigError> {
    let enforce = match &args.command {
        RemoteCommand::Enforce(enforce) => enforce,
        RemoteCommand::Doctor(d) => {
            let ha = ha_spec(&d.ha, Duration::ZERO)?;
            let inventory = load_hosts(&args)?;
            let device_caps = inventory.as_ref().is_some_and(|i| {
                i.caps.max_devices_per_user.is_some() || !i.caps.max_devices_for_user.is_empty()
            });
            let (mut fleet, control_dir) = ssh_fleet(
                &args,
                inventory,
                AgentLifetime::OneCycle,
                Duration::ZERO,
                crate::snapshot::genv::DEFAULT_MAX_RECORDS,
                None,
            )?;
            fleet.set_fencing(&fencing(ha.as_ref()));
            return Ok(Job::Doctor {
                fleet,
                format: format(d.output),
                control_dir,
                ha,
                device_caps,
            });
        }
    };
    let inventory = load_hosts(&args)?;
    let mut policy = policy(&enforce.rules);
    if let Some(inv) = &inventory {
        // Flags win over the inventory's caps.
        policy.max_devices_per_user = policy
            .max_devices_per_user
            .or(inv.caps.max_devices_per_user);
        let mut caps = inv.caps.max_devices_for_user.clone();
        caps.extend(policy.max_devices_for_user);
        policy.max_devices_for_user = caps;
    }
    let mut settings = settings(
        &enforce.cycle,
        policy,
        Mode::Remote,
        enforce.snapshot_dir.is_some(),
    );
    settings.cycle.exit_on_error = args.exit_on_error;
    settings.quiet = args.quiet;
    let emails = inventory
        .as_ref()
        .map(|i| i.emails.clone())
        .unwrap_or_default();
    settings.grace.rules = enforce.rules.graces();
    if let Some(inv) = &inventory {
        // The inventory's [policy.<rule>] wins over a flag's grace.
        settings.grace.rules.extend(inv.policy.clone());
        settings.grace.exempt = inv.exempt.clone();
    }
    let settings = with_notify(settings, &enforce.cycle, &emails)?;
    let settings = with_ha(settings, &enforce.cycle, enforce.snapshot_dir.is_some())?;
    if let Some(dir) = &enforce.snapshot_dir {
        let ids = match inventory {
            Some(i) => i.hosts.into_iter().map(|h| h.id).collect(),
            None => recorded_hosts(dir)?,
        };
        let hosts = ids
            .into_iter()
            .map(|id| {
                Host::Recorded(Recorded {
                    path: dir.join(format!("{id}.json")),
                    id,
                })
            })
            .collect();
        return Ok(Job::Enforce {
            metrics: enforce.cycle.metrics_listen,
            web: web(&enforce.cycle)?,
            fleets: with_audit(
                vec![Fleet::new(hosts, usize::from(args.concurrency))],
                &enforce.cycle,
            )?,
            settings: with_state(settings, &enforce.cycle)?,
            control_dir: None,
        });
    }
    let lifetime = if settings.interval.is_zero() {
        AgentLifetime::OneCycle
    } else {
        AgentLifetime::Kept
    };
    let (mut fleet, control_dir) = ssh_fleet(
        &args,
        inventory,
        lifetime,
        settings.interval,
        enforce.cycle.max_records,
        Some(&settings.cycle.policy),
    )?;
    fleet.set_fencing(&fencing(settings.ha.as_deref()));
    let fleet = sharded(fleet, &settings)?;
    Ok(Job::Enforce {
        metrics: enforce.cycle.metrics_listen,
        web: web(&enforce.cycle)?,
        fleets: with_audit(vec![fleet], &enforce.cycle)?,
        settings: with_state(settings, &enforce.cycle)?,
        control_dir,
    })
}

/// The SSH hosts of `inventory` (one of -H, --hostfile, --inventory is
/// required), and the temporary socket directory if we made one.
fn ssh_fleet(
    args: &RemoteArgs,
    inventory: Option<Inventory>,
    lifetime: AgentLifetime,
    interval: Duration,
    max_records: usize,
    policy: Option<&Policy>,
) -> Result<(Fleet, Option<tempfile::TempDir>), ConfigError> {
    let mut inventory = inventory.ok_or(ConfigError::NoHostsGiven)?;
    let groups: Vec<String> = inventory
        .exempt
        .iter()
        .filter_map(|e| e.group.clone())
        .chain(
            policy
                .into_iter()
                .flat_map(|p| p.max_devices_per_group.keys().cloned()),
        )
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let utilization = policy.is_some_and(|p| p.idle.is_some());
    for h in &mut inventory.hosts {
        h.identity_file = h
            .identity_file
            .take()
            .or_else(|| args.identity_file.clone());
    }
    let (control_dir, temp) = match &args.control_dir {
        Some(d) => {
            crate::private::writable_only_by_us(d).map_err(|source| ConfigError::ControlDir {
                dir: d.clone(),
                source,
            })?;
            (d.clone(), None)
        }
        None => {
            let t = tempfile::Builder::new()
                .prefix("genv-enforce-")
                .tempdir()
                .map_err(ConfigError::TempDir)?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let ssh = Arc::new(SshOptions {
        connect_timeout: args.timeout.map(Duration::from_secs),
        control_dir,
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
    });
    let hosts = inventory
        .hosts
        .into_iter()
        .map(|spec| {
            let mut host = LiveHost::ssh(spec, Arc::clone(&ssh), args.command_timeout, lifetime);
            host.agent.max_records = max_records;
            host.agent.groups.clone_from(&groups);
            host.agent.utilization = utilization;
            Host::Live(Box::new(host))
        })
        .collect();
    Ok((Fleet::new(hosts, usize::from(args.concurrency)), temp))
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

/// `--web.config.file`, read and checked.
fn web(c: &CycleArgs) -> Result<Option<crate::web_config::WebConfig>, ConfigError> {
    Ok(c.web_config_file
        .as_deref()
        .map(crate::web_config::WebConfig::load)
        .transpose()?)
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
            exit_on_error: false,
            kill_after: c.kill_after,
            // Only a run that keeps or serves them samples usage.
            sample_usage: c.state_db.is_some() || c.metrics_listen.is_some(),
            idle_gap: gap.unwrap_or(crate::state_db::MAX_SAMPLE_GAP),
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

/// `settings` with `--ha-*` resolved; a replay has no hosts to fence.
fn with_ha(mut settings: Settings, c: &CycleArgs, replay: bool) -> Result<Settings, ConfigError> {
    let spec = ha_spec(&c.ha, settings.interval)?;
    if spec.is_some() && (replay || settings.cycle.dry_run) {
        return Err(HaFlagError::DryRun.into());
    }
    if settings.cycle.mode == Mode::Local && spec.as_ref().is_some_and(|s| s.shard.is_some()) {
        return Err(HaFlagError::LocalShard.into());
    }
    settings.ha = spec.map(Arc::new);
    Ok(settings)
}

/// The fence the hosts of a run keep: on under `--ha-etcd`.
fn fencing(ha: Option<&crate::ha::HaSpec>) -> crate::host::fence::Fencing {
    ha.map_or_else(crate::host::fence::Fencing::default, |h| {
        crate::host::fence::Fencing::new(h.fence_dir.clone())
    })
}

/// `--ha-*` checked: URLs, the fence directory, TLS files, the password.
fn ha_spec(
    a: &crate::cli::HaArgs,
    interval: Duration,
) -> Result<Option<crate::ha::HaSpec>, ConfigError> {
    use crate::ha::{HaSpec, TlsSpec};
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
    let user = match (&a.ha_user, &a.ha_password_file) {
        (Some(user), Some(path)) => {
            let text =
                crate::private::read_secret(path).map_err(|source| HaFlagError::PasswordFile {
                    path: path.clone(),
                    source,
                })?;
            let password = text.lines().next().unwrap_or("").to_string();
            if password.is_empty() {
                return bad(HaFlagError::EmptyPassword(path.clone()));
            }
            Some((user.clone(), crate::ha::Secret(password)))
        }
        _ => None,
    };
    let name = match &a.ha_name {
        Some(n) if !n.is_empty() && !n.chars().any(char::is_control) && n.len() <= 255 => n.clone(),
        Some(n) => return bad(HaFlagError::Name(n.clone())),
        None => crate::host::local::hostname().0,
    };
    Ok(Some(HaSpec {
        endpoints: a.ha_etcd.clone(),
        key: a.ha_key.clone(),
        name,
        ttl: a.ha_ttl.unwrap_or_else(|| crate::ha::default_ttl(interval)),
        fence_dir: dir.clone(),
        tls: a.ha_cacert.as_ref().map(|ca| TlsSpec {
            ca: ca.clone(),
            identity: a.ha_cert.clone().zip(a.ha_cert_key.clone()),
        }),
        user,
        shard: a.shard,
    }))
}

/// `fleet` cut to `settings`' shard (`--shard K/N`): its hosts at places
/// K, K+N, ... of the inventory, each with its place. Only the per-user
/// device caps count across shards: the other caps are refused.
fn sharded(mut fleet: Fleet, settings: &Settings) -> Result<Fleet, ConfigError> {
    let Some(shard) = settings.ha.as_ref().and_then(|h| h.shard) else {
        return Ok(fleet);
    };
    let p = &settings.cycle.policy;
    if !p.max_devices_per_group.is_empty() || p.has_memory_caps() {
        return Err(HaFlagError::ShardCaps.into());
    }
    let hosts = std::mem::take(&mut fleet.hosts);
    for (position, host) in hosts.into_iter().enumerate() {
        if shard.holds(position) {
            fleet.positions.insert(host.id().clone(), position);
            fleet.hosts.push(host);
        }
    }
    if fleet.hosts.is_empty() {
        return Err(HaFlagError::EmptyShard {
            k: shard.k,
            n: shard.n,
        }
        .into());
    }
    Ok(fleet)
}

/// The notification channels of the flags, each checked (addresses,
/// URLs, the credentials file); `users`: the inventory's addresses.
fn with_notify(
    mut settings: Settings,
    c: &CycleArgs,
    users: &std::collections::BTreeMap<String, String>,
) -> Result<Settings, ConfigError> {
    use crate::notify::{mail, MailSpec, Notify, NotifyError, WebhookSpec};
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
            let credentials = match &c.smtp_credentials {
                None => None,
                Some(path) => Some(mail::credentials(
                    &path.display().to_string(),
                    &crate::private::read_secret(path).map_err(|source| {
                        NotifyError::Credentials {
                            path: path.display().to_string(),
                            source,
                        }
                    })?,
                )?),
            };
            Some(MailSpec {
                url: url.clone(),
                credentials,
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
    let url = match (&c.webhook, &c.webhook_file) {
        (Some(url), _) => Some(url.clone()),
        (None, Some(path)) => {
            let text =
                crate::private::read_secret(path).map_err(|source| NotifyError::WebhookFile {
                    path: path.display().to_string(),
                    source,
                })?;
            Some(text.trim().to_string())
        }
        (None, None) => None,
    };
    let webhook = url.map(|url| WebhookSpec {
        url,
        timeout: std::time::Duration::from_secs(10),
        attempts: 4,
    });
    let notify = Notify {
        mail,
        webhook,
        terminal: c.notify_terminal,
        per_user_hour: c.notify_rate,
    };
    // Set up once here, so that a bad URL is a usage error before anything runs.
    crate::notify::check(&notify)?;
    if notify.any() && !settings.cycle.dry_run {
        settings.notify = Some(Arc::new(notify));
    }
    Ok(settings)
}

/// Opens `--state-db`, if given, for `settings`.
fn with_state(mut settings: Settings, c: &CycleArgs) -> Result<Settings, ConfigError> {
    if let Some(path) = &c.state_db {
        settings.state = Some(Arc::new(crate::state_db::StateDb::open(path)?));
    }
    Ok(settings)
}

/// Opens `--audit-log` and hands it to every fleet.
fn with_audit(mut fleets: Vec<Fleet>, c: &CycleArgs) -> Result<Vec<Fleet>, ConfigError> {
    if let Some(path) = &c.audit_log {
        let log = Arc::new(AuditLog::open(path)?);
        for f in &mut fleets {
            f.audit = Some(Arc::clone(&log));
        }
    }
    Ok(fleets)
}

fn format(f: OutputFormat) -> Format {
    match f {
        OutputFormat::Text => Format::Text,
        OutputFormat::Json => Format::Json,
    }
}

/// The hosts named by -H, --hostfile or --inventory, if any.
fn load_hosts(args: &RemoteArgs) -> Result<Option<Inventory>, ConfigError> {
    let overrides = Overrides {
        user: args.username.clone(),
    };
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
            path: p.to_path_buf(),
            source,
        })
    };
    if let Some(list) = &args.host {
        let hosts = inventory::parse_host_list(list, &overrides).map_err(ConfigError::HostList)?;
        return Ok(Some(Inventory {
            hosts,
            ..Inventory::default()
        }));
    }
    if let Some(path) = &args.hostfile {
        let hosts =
            inventory::parse_hostfile(&read(path)?, &path.display().to_string(), &overrides)?;
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
            &read(path)?,
            &path.display().to_string(),
            &overrides,
        )?));
    }
    Ok(None)
}

/// Every `<host>.json` in `dir`, by name.
fn recorded_hosts(dir: &Path) -> Result<Vec<HostId>, ConfigError> {
    let entries = std::fs::read_dir(dir).map_err(|source| ConfigError::SnapshotDir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut names: Vec<HostId> = entries
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            let stem = p.file_stem()?.to_string_lossy().into_owned();
            (p.extension()? == "json").then_some(HostId(stem))
        })
        .collect();
    if names.is_empty() {
        return Err(ConfigError::NoSnapshots {
            dir: dir.to_path_buf(),
        });
    }
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::os::unix::fs::PermissionsExt;

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
        ha_spec(&cycle(args).ha, Duration::from_secs(10)).map_err(|e| crate::error::chain(&e))
    }

    #[test]
    fn ha_flags_are_checked_and_given_their_defaults() {
        assert_eq!(ha(&[]), Ok(None));
        let spec = ha(&["--ha-etcd", "http://10.0.0.1:2379,http://10.0.0.2:2379"])
            .unwrap()
            .unwrap();
        assert_eq!(spec.endpoints.len(), 2);
        assert_eq!(spec.key, crate::ha::DEFAULT_KEY);
        assert_eq!(spec.name, crate::host::local::hostname().0);
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
    fn the_etcd_password_file_must_be_ours_alone_and_not_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        let file = path.to_str().unwrap();
        let args = [
            "--ha-etcd",
            "http://e:2379",
            "--ha-user",
            "enf",
            "--ha-password-file",
            file,
        ];
        std::fs::write(&path, "s3cret\nignored\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let spec = ha(&args).unwrap().unwrap();
        assert_eq!(
            spec.user,
            Some(("enf".into(), crate::ha::Secret("s3cret".into())))
        );
        let said = format!("{spec:?}");
        assert!(!said.contains("s3cret") && said.contains("***"), "{said}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(ha(&args).unwrap_err().contains("others may read"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, "\n").unwrap();
        assert!(ha(&args).unwrap_err().contains("empty"));
    }

    fn settings_with(args: &[&str], mode: Mode) -> Result<Settings, String> {
        let c = cycle(args);
        let policy = crate::rules::Policy::default();
        with_ha(settings(&c, policy, mode, false), &c, false).map_err(|e| crate::error::chain(&e))
    }

    #[test]
    fn a_dry_run_elects_nobody_and_shards_split_remote_fleets_only() {
        let etcd = ["--ha-etcd", "http://e:2379"];
        assert!(settings_with(&etcd, Mode::Remote).unwrap().ha.is_some());
        let dry = [&etcd[..], &["--dry-run"]].concat();
        assert!(settings_with(&dry, Mode::Remote)
            .unwrap_err()
            .contains("a dry run"));
        let c = cycle(&etcd);
        let e = with_ha(
            settings(&c, Default::default(), Mode::Remote, true),
            &c,
            true,
        );
        assert!(e.is_err(), "a replay");
        let shard = [&etcd[..], &["--shard", "1/2"]].concat();
        assert!(settings_with(&shard, Mode::Local)
            .unwrap_err()
            .contains("remote"));
        assert!(settings_with(&shard, Mode::Remote).is_ok());
    }

    #[test]
    fn a_local_run_under_ha_fences_its_host_with_the_fence_the_election_sets() {
        let cli =
            Cli::try_parse_from(["genv-enforce", "enforce", "--ha-etcd", "http://e:2379"]).unwrap();
        let Ok(Job::Enforce { fleets, .. }) = resolve(cli) else {
            panic!("not an enforcing job")
        };
        let fleet = &fleets[0];
        assert_eq!(fleet.fencing.dir(), Some(crate::ha::FENCE_DIR));
        // What the election sets is what the host's requests carry.
        fleet.fencing.set(Some(7), None);
        let Host::Live(h) = &fleet.hosts[0] else {
            panic!("a live host")
        };
        assert_eq!(h.agent.fencing.current().map(|f| f.epoch), Some(7));
    }

    fn recorded_fleet(n: usize) -> Fleet {
        let hosts = (0..n)
            .map(|i| {
                Host::Recorded(Recorded {
                    id: HostId(format!("h{}", i + 1)),
                    path: PathBuf::from("/nonexistent"),
                })
            })
            .collect();
        Fleet::new(hosts, 4)
    }

    #[test]
    fn a_shard_keeps_every_nth_host_with_its_place_and_refuses_caps_it_cannot_count() {
        let args = ["--ha-etcd", "http://e:2379", "--shard", "2/3"];
        let s = settings_with(&args, Mode::Remote).unwrap();
        let f = sharded(recorded_fleet(7), &s).unwrap();
        let ids: Vec<&str> = f.hosts.iter().map(|h| h.id().0.as_str()).collect();
        assert_eq!(ids, ["h2", "h5"]);
        let mut places: Vec<(String, usize)> =
            f.positions.iter().map(|(h, p)| (h.0.clone(), *p)).collect();
        places.sort();
        assert_eq!(places, [("h2".into(), 1), ("h5".into(), 4)]);
        // Unsharded: the fleet as it was, no places.
        let whole = settings_with(&["--ha-etcd", "http://e:2379"], Mode::Remote).unwrap();
        let f = sharded(recorded_fleet(3), &whole).unwrap();
        assert_eq!((f.hosts.len(), f.positions.len()), (3, 0));
        let e = crate::error::chain(&sharded(recorded_fleet(1), &s).unwrap_err());
        assert!(e.contains("no host of the inventory falls in it"), "{e}");
        let mut grouped = s.clone();
        grouped.cycle.policy.max_devices_per_group = [("lab".to_string(), 2)].into_iter().collect();
        assert!(
            crate::error::chain(&sharded(recorded_fleet(3), &grouped).unwrap_err())
                .contains("--max-devices-per-group")
        );
        let mut memory = s;
        memory.cycle.policy.max_memory_per_user = Some(1 << 30);
        assert!(sharded(recorded_fleet(3), &memory).is_err());
    }
}
