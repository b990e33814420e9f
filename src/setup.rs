//! The I/O around [`config::resolve`]: [`read`] what the command line names
//! (its host list or inventory, the recorded snapshots, this machine's name
//! and genv directory), then [`build`] what the checked request asks for:
//! read the secrets, make the SSH control directory, open the audit log and
//! the state database, load the metrics endpoint's web config, and build
//! the hosts.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{CommandFactory, Parser};
use thiserror::Error;

use crate::audit::{AuditError, AuditLog};
use crate::cli::{Cli, Command, RemoteCommand};
use crate::config::{
    self, AgentTuning, ConfigError, Doctor, Enforce, Ha, Here, Hosts, Notifications, Read, Request,
    Settings, SshHosts,
};
use crate::config_file::{self, Problem};
use crate::fleet::Fleet;
use crate::ha::HaSpec;
use crate::host::fence::Fencing;
use crate::host::{local, Host, LiveHost};
use crate::model::HostId;
use crate::notify::{mail, Notify, NotifyError, WebhookSpec};
use crate::report::Format;

/// What a command line asks for, ready to run.
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
        /// `--view-socket` and `--view-group`.
        view: Option<(PathBuf, Option<String>)>,
    },
    /// This machine's snapshot as genv prints it.
    Snapshot(Box<LiveHost>),
    /// `report` over a state database.
    Report(crate::cli::ReportArgs),
    /// `status`: the running service's view, printed once.
    Status(crate::cli::StatusArgs),
    /// `top`: the running service's views, live.
    Top(crate::cli::TopArgs),
    /// Man pages and completions written under this directory.
    Docs(PathBuf),
    /// `doctor` over these hosts (and etcd, under `--ha-etcd`).
    Doctor {
        fleet: Fleet,
        format: Format,
        control_dir: Option<tempfile::TempDir>,
        ha: Option<HaSpec>,
        /// The inventory caps devices per user (doctor says what that
        /// leaves open).
        device_caps: bool,
    },
}

/// A command line that is wrong, or names what cannot be read or opened.
#[derive(Debug, Error)]
pub enum SetupError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{}", located(path, problems))]
    ConfigFile {
        path: PathBuf,
        problems: Vec<Problem>,
    },
    /// A configuration file (`--config`, an inventory, a hostfile) that
    /// cannot be read, or is refused ([`crate::private::read_config`]).
    #[error("{}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: crate::private::Refusal,
    },
    /// The inventory (or hostfile) the configuration names is not there
    /// yet: on a new install, the admin's to write.
    #[error(
        "{}: no such file: write it, the hosts to enforce (--{flag}); a start: \
         `install -m 600 /usr/share/genv-enforce/hosts.example.toml {}`, then edit its [[host]] \
         tables (docs/first-fleet.md, \"The inventory\")",
        path.display(),
        path.display()
    )]
    NoHostsFile { path: PathBuf, flag: &'static str },
    #[error("--snapshot-dir {}", dir.display())]
    SnapshotDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    StateDb(#[from] crate::state_db::StateDbError),
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
    Notify(#[from] NotifyError),
    #[error("--ha-etcd: --ha-password-file {}", path.display())]
    HaPassword {
        path: PathBuf,
        #[source]
        source: crate::private::Refusal,
    },
    #[error("--ha-etcd: --ha-password-file {}: empty", .0.display())]
    HaPasswordEmpty(PathBuf),
    #[error(transparent)]
    Web(#[from] crate::web_config::WebConfigError),
    /// `top`'s cycles of its own cannot run on this configuration.
    #[error("{}: {why}", path.display())]
    Look { path: PathBuf, why: String },
}

/// A command line as typed, and as run: with its configuration file
/// applied (what SIGHUP compares a reload with).
#[derive(Debug, Clone, Default)]
pub struct CommandLine {
    pub typed: Vec<OsString>,
    pub run: Vec<OsString>,
}

/// The command line `args` with the configuration file it names
/// (`--config`) applied ([`config_file::apply`]); `args` as they are
/// without one, or for `config` itself (which checks the file).
///
/// # Errors
/// The file cannot be read, or fails the check.
pub fn config_args(args: Vec<OsString>) -> Result<Vec<OsString>, SetupError> {
    let Some(path) = config_file::path_in(&args) else {
        return Ok(args);
    };
    let root = Cli::command();
    if config_file::command_of(&root, &args)
        .first()
        .map(String::as_str)
        == Some("config")
    {
        return Ok(args);
    }
    let settings = config_settings(std::path::Path::new(&path), &root)?;
    Ok(config_file::apply(&root, &args, &settings).0)
}

/// The settings of the configuration file at `path`, read as
/// [`crate::private::read_config`] reads and checked against `root`'s
/// flags.
///
/// # Errors
/// The file cannot be read, is refused, or fails the check.
pub fn config_settings(
    path: &std::path::Path,
    root: &clap::Command,
) -> Result<Vec<config_file::Setting>, SetupError> {
    let text = crate::private::read_config(path).map_err(|source| SetupError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    config_file::parse(&text, root).map_err(|problems| SetupError::ConfigFile {
        path: path.to_path_buf(),
        problems,
    })
}

/// The digest of the configuration the command line `run` gives
/// ([`config_file::digest`]), its inventory or hostfile read again (a
/// file that cannot be read counts as its error's words).
pub fn config_digest(run: &[OsString]) -> String {
    let root = Cli::command();
    let named = config_file::values_of(&root, run, &["inventory", "hostfile"]);
    let hosts = named.values().flatten().next().map(|path| {
        crate::private::read_config(std::path::Path::new(path))
            .unwrap_or_else(|e| crate::error::chain(&e))
    });
    config_file::digest(&root, run, hosts.as_deref())
}

/// `path:line:column: message`, `; `-separated (an error is one line).
fn located(path: &std::path::Path, problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("{}:{p}", path.display()))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A dry run of the configuration file at `path`, for `top` with no
/// service to attach to: its hosts, rules and policy
/// ([`config_file::for_a_look`]); the fleet, its settings and what must
/// live as long as its hosts (their SSH sockets' directory).
///
/// # Errors
/// The file cannot be read or fails the check; what it names cannot be
/// read or built; it replays several files (one fleet each).
pub fn look(
    path: &std::path::Path,
) -> Result<(Fleet, Settings, Option<tempfile::TempDir>), SetupError> {
    let root = Cli::command();
    let mut settings = config_file::for_a_look(&config_settings(path, &root)?);
    // A look never trusts a new host key on the service's behalf.
    settings.retain(|s| s.key != "host-key-check");
    settings.push(config_file::Setting {
        key: "host-key-check".into(),
        values: vec!["strict".into()],
        on: true,
        at: config_file::At { line: 0, column: 0 },
    });
    let line = [OsString::from("genv-enforce"), OsString::from("--dry-run")];
    let (args, _) = config_file::apply(&root, &line, &settings);
    let look = |why: String| SetupError::Look {
        path: path.to_path_buf(),
        why,
    };
    let cli = Cli::try_parse_from(&args).map_err(|e| look(e.to_string()))?;
    match job(cli)? {
        Job::Enforce {
            mut fleets,
            settings,
            control_dir,
            ..
        } if fleets.len() == 1 && settings.cycle.dry_run => {
            Ok((fleets.remove(0), settings, control_dir))
        }
        _ => Err(look("not one fleet to look at".into())),
    }
}

/// The job `cli` asks for: [`read`], [`config::resolve`], [`build`].
///
/// # Errors
/// See [`SetupError`].
pub fn job(cli: Cli) -> Result<Job, SetupError> {
    let read = read(&cli)?;
    build(config::resolve(cli, &read)?)
}

/// The job `cli` asks for again, on a reload: as [`job`], but the state
/// database is left to the running service (it holds it locked, and
/// `state-db` changes only with a restart).
///
/// # Errors
/// See [`SetupError`].
pub fn job_again(cli: Cli) -> Result<Job, SetupError> {
    let read = read(&cli)?;
    let mut request = config::resolve(cli, &read)?;
    if let Request::Enforce(e) = &mut request {
        e.state_db = None;
    }
    build(request)
}

/// What `cli` names, read: the host list or inventory, the recorded
/// snapshots of `--snapshot-dir` (when no host list names them), this
/// machine's name and genv directory.
///
/// # Errors
/// A file or directory that cannot be read.
pub fn read(cli: &Cli) -> Result<Read, SetupError> {
    let mut read = Read {
        hostname: local::hostname(),
        state_dir: local::state_dir_from_env(),
        ..Read::default()
    };
    let Command::Remote(args) = &cli.command else {
        return Ok(read);
    };
    if let Some(path) = config::hosts_file(args) {
        read.hosts_text = Some(crate::private::read_config(path).map_err(
            |source| match source {
                crate::private::Refusal::Io(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    SetupError::NoHostsFile {
                        path: path.to_path_buf(),
                        flag: if args.hostfile.is_some() {
                            "hostfile"
                        } else {
                            "inventory"
                        },
                    }
                }
                source => SetupError::Read {
                    path: path.to_path_buf(),
                    source,
                },
            },
        )?);
    }
    let named = args.host.is_some() || read.hosts_text.is_some();
    if let (RemoteCommand::Enforce(e), false) = (&args.command, named) {
        if let Some(dir) = &e.snapshot_dir {
            read.recorded = recorded_hosts(dir)?;
        }
    }
    Ok(read)
}

/// Every `<host>.json` in `dir`, by name.
fn recorded_hosts(dir: &std::path::Path) -> Result<Vec<HostId>, SetupError> {
    let entries = std::fs::read_dir(dir).map_err(|source| SetupError::SnapshotDir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut names: Vec<HostId> = entries
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            let stem = p.file_stem()?.to_string_lossy().into_owned();
            (p.extension()? == "json").then_some(HostId(stem.into()))
        })
        .collect();
    names.sort();
    Ok(names)
}

/// Opens and builds what `request` asks for.
///
/// # Errors
/// A secret, the control directory, the audit log, the state database or
/// the web config that cannot be read, made or opened.
pub fn build(request: Request) -> Result<Job, SetupError> {
    match request {
        Request::Snapshot(here) => Ok(Job::Snapshot(Box::new(local_host(&here)))),
        Request::Report(args) => Ok(Job::Report(args)),
        Request::Status(args) => Ok(Job::Status(args)),
        Request::Top(args) => Ok(Job::Top(args)),
        Request::Docs(dir) => Ok(Job::Docs(dir)),
        Request::Doctor(d) => {
            let Doctor {
                hosts,
                format,
                ha,
                device_caps,
            } = *d;
            let ha = ha.map(ha_spec).transpose()?;
            let (mut fleets, control_dir) = fleets(hosts)?;
            let mut fleet = fleets.pop().unwrap_or_else(|| Fleet::new(Vec::new(), 1));
            fleet.set_fencing(&fencing(ha.as_ref()));
            Ok(Job::Doctor {
                fleet,
                format,
                control_dir,
                ha,
                device_caps,
            })
        }
        Request::Enforce(e) => enforce(*e),
    }
}

fn enforce(e: Enforce) -> Result<Job, SetupError> {
    let Enforce {
        mut settings,
        hosts,
        notify,
        ha,
        state_db,
        audit_log,
        metrics,
        web_config,
        view_socket,
        view_group,
    } = e;
    let web = web_config
        .as_deref()
        .map(crate::web_config::WebConfig::load)
        .transpose()?;
    settings.ha = ha.map(ha_spec).transpose()?.map(Arc::new);
    if let Some(n) = notify {
        let notify = notify_with_secrets(n)?;
        // Set up once here, so that a bad URL is a usage error before
        // anything runs.
        crate::notify::check(&notify)?;
        if notify.any() && !settings.cycle.dry_run {
            settings.notify = Some(Arc::new(notify));
        }
    }
    let (mut fleets, control_dir) = fleets(hosts)?;
    // One fence for a fleet and its hosts: the election sets the fleet's,
    // the hosts' requests carry it.
    let fence = fencing(settings.ha.as_deref());
    for f in &mut fleets {
        f.set_fencing(&fence);
    }
    if let Some(path) = &audit_log {
        let log = Arc::new(AuditLog::open(path)?);
        for f in &mut fleets {
            f.audit = Some(Arc::clone(&log));
        }
    }
    if let Some(path) = &state_db {
        settings.state = Some(Arc::new(crate::state_db::StateDb::open(path)?));
    }
    Ok(Job::Enforce {
        fleets,
        settings,
        control_dir,
        metrics,
        web,
        view: view_socket.map(|p| (p, view_group)),
    })
}

/// The fleets of `hosts`, and the temporary socket directory if one was
/// made.
fn fleets(hosts: Hosts) -> Result<(Vec<Fleet>, Option<tempfile::TempDir>), SetupError> {
    Ok(match hosts {
        Hosts::Here(here) => (
            vec![Fleet::new(vec![Host::Live(Box::new(local_host(&here)))], 1)],
            None,
        ),
        Hosts::Files(files) => (
            files
                .into_iter()
                .map(|r| Fleet::new(vec![Host::Recorded(r)], 1))
                .collect(),
            None,
        ),
        Hosts::Recorded { hosts, concurrency } => (
            vec![Fleet::new(
                hosts.into_iter().map(Host::Recorded).collect(),
                concurrency,
            )],
            None,
        ),
        Hosts::Ssh(ssh) => {
            let (fleet, temp) = ssh_fleet(*ssh)?;
            (vec![fleet], temp)
        }
    })
}

/// This machine's host.
fn local_host(here: &Here) -> LiveHost {
    let mut host = LiveHost::local(here.id.clone(), here.state_dir.clone(), here.timeout);
    tune(&mut host, &here.agent);
    host
}

fn tune(host: &mut LiveHost, agent: &AgentTuning) {
    host.agent.max_records = agent.max_records;
    host.agent.groups.clone_from(&agent.groups);
    host.agent.utilization = agent.utilization;
}

/// The SSH hosts, with their control directory: `--control-dir` if only
/// we may write it, else a private temporary one (returned, to be kept).
fn ssh_fleet(hosts: SshHosts) -> Result<(Fleet, Option<tempfile::TempDir>), SetupError> {
    let SshHosts {
        specs,
        positions,
        mut ssh,
        command_timeout,
        lifetime,
        agent,
        concurrency,
    } = hosts;
    let temp = if ssh.control_dir.as_os_str().is_empty() {
        let t = tempfile::Builder::new()
            .prefix("genv-enforce-")
            .tempdir_in(sockets_parent(std::env::var_os("RUNTIME_DIRECTORY")))
            .map_err(SetupError::TempDir)?;
        ssh.control_dir = t.path().to_path_buf();
        Some(t)
    } else {
        crate::private::writable_only_by_us(&ssh.control_dir).map_err(|source| {
            SetupError::ControlDir {
                dir: ssh.control_dir.clone(),
                source,
            }
        })?;
        None
    };
    let ssh = Arc::new(ssh);
    let hosts = specs
        .into_iter()
        .map(|spec| {
            let mut host = LiveHost::ssh(spec, Arc::clone(&ssh), command_timeout, lifetime);
            tune(&mut host, &agent);
            Host::Live(Box::new(host))
        })
        .collect();
    let mut fleet = Fleet::new(hosts, concurrency);
    fleet.positions = positions;
    Ok((fleet, temp))
}

/// Where the private directory for the SSH sockets is made when
/// `--control-dir` is not given: the first of systemd's
/// `$RUNTIME_DIRECTORY` (the unit's `RuntimeDirectory=`, writable under
/// `ProtectSystem=strict`, where `/tmp` is not), else the temporary
/// directory.
fn sockets_parent(runtime: Option<OsString>) -> PathBuf {
    runtime
        .as_deref()
        .and_then(|dirs| std::env::split_paths(dirs).find(|d| d.is_absolute()))
        .unwrap_or_else(std::env::temp_dir)
}

/// The fence the hosts of a run keep: on under `--ha-etcd`.
fn fencing(ha: Option<&HaSpec>) -> Fencing {
    ha.map_or_else(Fencing::default, |h| Fencing::new(h.fence_dir.clone()))
}

/// `ha` with its password read (`--ha-password-file`: ours alone, its
/// first line).
fn ha_spec(ha: Ha) -> Result<HaSpec, SetupError> {
    let Ha { mut spec, login } = ha;
    if let Some((user, path)) = login {
        let text = crate::private::read_secret(&path).map_err(|source| SetupError::HaPassword {
            path: path.clone(),
            source,
        })?;
        let password = text.lines().next().unwrap_or("").to_string();
        if password.is_empty() {
            return Err(SetupError::HaPasswordEmpty(path));
        }
        spec.user = Some((user, crate::ha::Secret(password)));
    }
    Ok(spec)
}

/// The channels with their secrets read: the SMTP credentials and the
/// webhook's URL from its file.
fn notify_with_secrets(n: Notifications) -> Result<Notify, SetupError> {
    let Notifications {
        mut notify,
        credentials_file,
        webhook_file,
    } = n;
    if let (Some(m), Some(path)) = (&mut notify.mail, &credentials_file) {
        let name = path.display().to_string();
        let text =
            crate::private::read_secret(path).map_err(|source| NotifyError::Credentials {
                path: name.clone(),
                source,
            })?;
        m.credentials = Some(mail::credentials(&name, &text)?);
    }
    if let Some(path) = &webhook_file {
        let text =
            crate::private::read_secret(path).map_err(|source| NotifyError::WebhookFile {
                path: path.display().to_string(),
                source,
            })?;
        notify.webhook = Some(WebhookSpec::new(text.trim().to_string()));
    }
    Ok(notify)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// `top`'s look of its own is a dry run of the file's hosts, rules
    /// and policy: no state database, audit log, notification, metrics,
    /// view or election, and nothing of theirs made.
    #[test]
    fn a_look_is_a_dry_run_of_the_files_hosts_rules_and_policy() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let snaps = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/snapshots");
        let text = format!(
            "[hosts]\nsnapshot-dir = \"{snaps}\"\n[rules]\nnon-env-processes = true\nmax-devices-per-user = 2\n\
             [policy]\ninterval = \"7s\"\n[state]\nstate-db = \"{db}\"\naudit-log = \"{audit}\"\n\
             [metrics]\nmetrics-listen = \"127.0.0.1:1\"\nview-socket = \"{sock}\"\n\
             [high-availability]\nha-etcd = [\"http://127.0.0.1:1\"]\n",
            db = d.join("state.db").display(),
            audit = d.join("audit.log").display(),
            sock = d.join("view.sock").display(),
        );
        let config = d.join("genv-enforce.toml");
        std::fs::write(&config, text).unwrap();
        let (fleet, settings, _keep) = look(&config).unwrap();
        assert_eq!(fleet.hosts.len(), 3);
        assert!(settings.cycle.dry_run);
        assert!(settings.state.is_none() && settings.ha.is_none() && settings.notify.is_none());
        // A replay runs once: top repeats it at its own pace.
        assert!(settings.interval.is_zero());
        assert_eq!(settings.cycle.policy.max_devices_per_user, Some(2));
        assert!(fleet.audit.is_none());
        assert!(settings.state.is_none());
        for made in ["state.db", "audit.log", "view.sock"] {
            assert!(!d.join(made).exists(), "{made} made");
        }
        // A file that cannot be used says so, named.
        std::fs::write(&config, "[rules]\nno-such-key = 1\n").unwrap();
        let e = crate::error::chain(&look(&config).unwrap_err());
        assert!(e.contains("genv-enforce.toml"), "{e}");
    }

    fn login(path: &std::path::Path) -> Result<HaSpec, String> {
        let args = [
            "genv-enforce",
            "enforce",
            "--ha-etcd",
            "http://e:2379",
            "--ha-user",
            "enf",
            "--ha-password-file",
            path.to_str().unwrap(),
        ];
        let cli = Cli::try_parse_from(args).unwrap();
        let Ok(Request::Enforce(e)) = config::resolve(cli, &Read::default()) else {
            panic!("not an enforcing request")
        };
        ha_spec(e.ha.unwrap()).map_err(|e| crate::error::chain(&e))
    }

    #[test]
    fn ssh_sockets_go_under_systemds_runtime_directory_when_it_names_one() {
        let under = |v: Option<&str>| sockets_parent(v.map(OsString::from));
        assert_eq!(
            under(Some("/run/genv-enforce")),
            PathBuf::from("/run/genv-enforce")
        );
        assert_eq!(under(Some("/run/a:/run/b")), PathBuf::from("/run/a"));
        assert_eq!(under(Some("relative:/run/b")), PathBuf::from("/run/b"));
        assert_eq!(under(None), std::env::temp_dir());
        assert_eq!(under(Some("")), std::env::temp_dir());
    }

    #[test]
    fn only_a_missing_inventory_is_one_to_write_other_failures_say_what_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let inventory = |path: &std::path::Path| {
            let cli = Cli::try_parse_from([
                "genv-enforce",
                "remote",
                "--inventory",
                path.to_str().unwrap(),
                "enforce",
            ])
            .unwrap();
            read(&cli).map(|_| ()).map_err(|e| crate::error::chain(&e))
        };
        let missing = dir.path().join("hosts.toml");
        let said = inventory(&missing).unwrap_err();
        assert!(
            said.contains("hosts.toml: no such file: write it"),
            "{said}"
        );
        // Under a file, not missing: the kernel's words, no invitation.
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        let said = inventory(&file.join("hosts.toml")).unwrap_err();
        assert!(said.contains("Not a directory"), "{said}");
        assert!(!said.contains("write it"), "{said}");
    }

    #[test]
    fn the_etcd_password_file_must_be_ours_alone_and_not_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        std::fs::write(&path, "s3cret\nignored\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let spec = login(&path).unwrap();
        assert_eq!(
            spec.user,
            Some(("enf".into(), crate::ha::Secret("s3cret".into())))
        );
        let said = format!("{spec:?}");
        assert!(!said.contains("s3cret") && said.contains("***"), "{said}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(login(&path).unwrap_err().contains("others may read"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, "\n").unwrap();
        assert!(login(&path).unwrap_err().contains("empty"));
    }

    #[test]
    fn a_local_run_under_ha_fences_its_host_with_the_fence_the_election_sets() {
        let cli =
            Cli::try_parse_from(["genv-enforce", "enforce", "--ha-etcd", "http://e:2379"]).unwrap();
        let Ok(Job::Enforce { fleets, .. }) = job(cli) else {
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

    #[test]
    fn a_snapshot_dir_is_listed_only_when_no_host_list_names_the_hosts() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["b.json", "a.json", "notes.txt"] {
            std::fs::write(dir.path().join(f), "{}").unwrap();
        }
        let d = dir.path().to_str().unwrap();
        let cli = |args: &[&str]| {
            let mut all = vec!["genv-enforce", "remote"];
            all.extend(args);
            all.extend(["enforce", "--snapshot-dir", d]);
            Cli::try_parse_from(all).unwrap()
        };
        let r = read(&cli(&[])).unwrap();
        assert_eq!(r.recorded, [HostId("a".into()), HostId("b".into())]);
        assert!(read(&cli(&["-H", "x"])).unwrap().recorded.is_empty());
        let Job::Enforce {
            fleets, settings, ..
        } = job(cli(&["-H", "b"])).unwrap()
        else {
            panic!("not enforcing")
        };
        assert!(settings.cycle.dry_run);
        let ids: Vec<&str> = fleets[0].hosts.iter().map(|h| &*h.id().0).collect();
        assert_eq!(ids, ["b"]);
        let missing = Cli::try_parse_from([
            "genv-enforce",
            "remote",
            "enforce",
            "--snapshot-dir",
            "/nonexistent",
        ])
        .unwrap();
        assert!(crate::error::chain(&read(&missing).unwrap_err()).contains("--snapshot-dir"));
    }

    /// `enforce <args>` made into a job, its settings and its host.
    fn local(args: &[&str]) -> (Settings, LiveHost) {
        let cli = Cli::try_parse_from(["genv-enforce", "enforce"].iter().chain(args)).unwrap();
        let Job::Enforce {
            mut fleets,
            settings,
            ..
        } = job(cli).unwrap_or_else(|e| panic!("{}", crate::error::chain(&e)))
        else {
            panic!("not enforcing")
        };
        let Some(Host::Live(h)) = fleets.remove(0).hosts.pop() else {
            panic!("not a live host")
        };
        (settings, *h)
    }

    #[test]
    fn this_machine_is_named_and_found_where_it_says() {
        let cli = Cli::try_parse_from(["genv-enforce", "enforce"]).unwrap();
        let r = read(&cli).unwrap();
        assert_eq!(r.hostname, local::hostname());
        assert_eq!(r.state_dir, local::state_dir_from_env());
        let (_, host) = local(&[]);
        assert_eq!(host.id(), &local::hostname());
    }

    #[test]
    fn the_host_is_tuned_as_the_rules_ask_and_a_dry_run_tells_nobody() {
        let (settings, host) = local(&[
            "--max-records",
            "50",
            "--max-devices-per-group",
            "lab=2",
            "--idle-after",
            "1h",
            "--notify-terminal",
        ]);
        assert_eq!(host.agent.max_records, 50);
        assert_eq!(host.agent.groups, ["lab"]);
        assert!(host.agent.utilization);
        assert!(settings.notify.is_some_and(|n| n.terminal));
        let (settings, _) = local(&["--notify-terminal", "--dry-run"]);
        assert!(settings.notify.is_none());
        let (settings, _) = local(&[]);
        assert!(settings.notify.is_none());
    }

    #[test]
    fn the_notification_secrets_are_read_from_their_files() {
        let dir = tempfile::tempdir().unwrap();
        let (hook, cred) = (dir.path().join("hook"), dir.path().join("cred"));
        std::fs::write(&hook, "http://127.0.0.1:9/h\n").unwrap();
        std::fs::write(&cred, "enforcer\ns3cret\n").unwrap();
        for f in [&hook, &cred] {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let (settings, _) = local(&[
            "--webhook-file",
            hook.to_str().unwrap(),
            "--smtp",
            "smtp://127.0.0.1:25",
            "--mail-from",
            "enforcer@lab.example",
            "--smtp-credentials",
            cred.to_str().unwrap(),
        ]);
        let n = settings.notify.unwrap();
        assert_eq!(
            n.webhook.as_ref().map(|w| w.url.as_str()),
            Some("http://127.0.0.1:9/h")
        );
        let m = n.mail.as_ref().unwrap();
        assert_eq!(
            m.credentials,
            Some(("enforcer".to_string(), "s3cret".to_string()))
        );
    }
}
