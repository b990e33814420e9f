//! Command-line types (clap derive), spelled as genv spells them so that
//! `genv` -> `genv-enforce` keeps an admin's command working. Only parsing
//! and validation here; nothing runs.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Enforce genv GPU environments: drop-in for `genv enforce`, faster and safer.
#[derive(Debug, Parser)]
#[command(name = "genv-enforce", version = VERSION, about, long_about = LONG_ABOUT, max_term_width = 100, after_help = EXAMPLES)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// More logging on stderr: -v info, -vv debug, -vvv trace
    /// (`GENV_ENFORCE_LOG` or `RUST_LOG` take a full filter instead).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// The configuration file: every setting as a key named as its flag,
    /// in sections (see `config check`); a flag on the command line wins.
    /// With no command, runs `remote enforce` if the file names hosts,
    /// else `enforce`.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// `--version`: the version and the commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("GENV_ENFORCE_COMMIT"),
    ")"
);

/// `--help` and the man page's description: the configuration file first.
const LONG_ABOUT: &str = "\
Fast, safe, drop-in enforcement of genv GPU environments on one host or a fleet

Configuration: a TOML file, /etc/genv-enforce/genv-enforce.toml for the
service (--config FILE anywhere), every setting a key named as its flag, in
sections [hosts], [rules], [policy], [notifications], [state], [metrics] and
[high-availability]; a flag on the command line wins over the file. The
hosts, their device caps, policies and exemptions are a second TOML file,
the inventory ([hosts] inventory = ...; see hosts.example.toml), whose keys
are spelled with underscores. `genv-enforce config check` checks a file
before use (exit status 2, each problem at its line and column);
`genv-enforce --config FILE` alone runs `remote enforce` if the file names
hosts, else `enforce`. genv's command lines (`genv` -> `genv-enforce`) work
unchanged.";

/// Common cases, shown under `--help`.
const EXAMPLES: &str = "\
Examples:
  This machine, every 10 s (as `genv enforce`):
    genv-enforce enforce --non-env-processes --max-devices-per-user 2
  A fleet over SSH:
    genv-enforce remote -H gpu1,gpu2,gpu3 enforce --non-env-processes --max-devices-per-user 2
  Once, from cron (exit 1: a failure, 3: a dry run found violations):
    genv-enforce remote --hostfile /etc/genv-enforce/hosts enforce --interval 0
  A dry run: report, touch nothing:
    genv-enforce remote --inventory hosts.toml enforce --dry-run --interval 0
  Replay recorded snapshots (`genv usage snapshot` files):
    genv-enforce remote enforce --snapshot-dir fixtures/snapshots --non-env-processes
  Check this machine, or every host, first:
    genv-enforce doctor
    genv-enforce remote --inventory hosts.toml doctor
  As a service, with an audit log and metrics (see contrib/):
    genv-enforce remote --inventory hosts.toml enforce \\
      --audit-log /var/log/genv-enforce/audit.log --metrics-listen 127.0.0.1:9400";

/// `enforce`'s common cases.
const ENFORCE_EXAMPLES: &str = "\
Examples:
  genv-enforce enforce --non-env-processes --max-devices-per-user 2
  genv-enforce enforce --interval 0 --dry-run          # once, report only
  genv-enforce enforce --snapshot gpu1.json gpu2.json  # replay recordings
  genv-enforce enforce --kill-after 30s --confirm-cycles 2 --audit-log audit.log";

/// `remote`'s common cases.
const REMOTE_EXAMPLES: &str = "\
Examples:
  genv-enforce remote -H gpu1,ops@gpu2:2222 enforce --non-env-processes --max-devices-per-user 2
  genv-enforce remote --inventory hosts.toml doctor
  genv-enforce remote --hostfile hosts enforce --interval 0 --output json
  genv-enforce remote enforce --snapshot-dir fixtures/snapshots --dry-run";

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Enforce GPU usage on this machine (as `genv enforce`).
    Enforce(Box<EnforceArgs>),
    /// Enforce GPU usage on remote hosts over SSH (as `genv remote ... enforce`).
    Remote(Box<RemoteArgs>),
    /// Check this machine before enforcing: privileges, Python and our
    /// agent, nvidia-smi, genv's state, a real snapshot, genv's version,
    /// tools; exit status 1 if a check fails. With --config naming hosts:
    /// every host, as `remote ... doctor`.
    Doctor(DoctorArgs),
    /// Print this machine's GPU usage as JSON (as `genv usage snapshot`),
    /// with each process's start time and uid added.
    Snapshot(SnapshotArgs),
    /// Who used how much, from a --state-db database: per user (or host),
    /// GPU-hours, peak GPUs, mean GPU memory, violations by rule,
    /// warnings, terminations and detaches.
    Report(ReportArgs),
    /// What the running service sees now (its last cycle): each host's
    /// GPUs and jobs, each user against their caps, what waits and when,
    /// and what was done; printed once (--output json: for scripts, its
    /// schema in contrib/genv-enforce-view.schema.json).
    Status(StatusArgs),
    /// The fleet live in the terminal, attached to the running service:
    /// every GPU, user and waiting action, with countdowns, a filter (/),
    /// a sort (s), why for any row (Enter) and help (?). While no service
    /// answers on the socket: dry-run cycles of its own from the
    /// configuration file (--config, else the service's), acting on
    /// nothing.
    Top(TopArgs),
    /// Check a configuration file (--config, default
    /// /etc/genv-enforce/genv-enforce.toml) without touching any host, or
    /// print its JSON Schema.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Write the man pages and the bash, zsh and fish completions, made
    /// from these very definitions, under DIR (for packagers).
    #[command(hide = true)]
    Docs(DocsArgs),
}

/// `config`'s subcommands.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check the file: unknown keys, wrong types, impossible values and
    /// contradictions, each at its line and column (exit status 2), as the
    /// command that runs with it would see them; touches no host.
    Check(ConfigCheckArgs),
    /// Print the file's JSON Schema (editors check and complete keys with it).
    Schema,
}

/// `config check` options.
#[derive(Debug, Args)]
pub struct ConfigCheckArgs {
    /// Also print the resolved configuration, each value with where it
    /// came from (file, flag, default); secrets are never printed.
    #[arg(long)]
    pub effective: bool,
    /// The command line to check the file with (after `--`), e.g.
    /// `-- remote --inventory hosts.toml enforce --dry-run`
    /// [default: what --config alone runs].
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<std::ffi::OsString>,
}

/// `status` options.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// The service's --view-socket, or its metrics endpoint's URL
    /// (http(s)://HOST:PORT, path /view; see --credentials).
    #[arg(long, value_name = "SOCKET|URL", default_value = crate::view_socket::DEFAULT_PATH)]
    pub connect: String,
    /// How long to wait for the service's view.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION", default_value = "10s")]
    pub timeout: Duration,
    /// For --connect URL: the metrics endpoint's USER:PASSWORD (basic
    /// authentication), from a file only you may read (chmod 600).
    #[arg(long, value_name = "FILE")]
    pub credentials: Option<PathBuf>,

    #[arg(long, value_enum, default_value_t = StatusOutput::Text)]
    pub output: StatusOutput,
    /// Print the JSON Schema of --output json (shipped as
    /// contrib/genv-enforce-view.schema.json) and exit.
    #[arg(long)]
    pub schema: bool,
}

/// `top` options.
#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// The service's --view-socket, or its metrics endpoint's URL
    /// (http(s)://HOST:PORT, path /view, asked every 5 s).
    #[arg(long, value_name = "SOCKET|URL", default_value = crate::view_socket::DEFAULT_PATH)]
    pub connect: String,
    /// For --connect URL: the metrics endpoint's USER:PASSWORD (basic
    /// authentication), from a file only you may read (chmod 600).
    #[arg(long, value_name = "FILE")]
    pub credentials: Option<PathBuf>,
    /// The configuration file (`--config`), for cycles of its own while
    /// no service answers.
    #[arg(skip)]
    pub config: Option<PathBuf>,
}

/// `status --output`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StatusOutput {
    /// A few lines per host, user and action.
    Text,
    /// The view as the service serves it: one JSON object.
    Json,
}

/// `docs` options.
#[derive(Debug, Args)]
pub struct DocsArgs {
    /// Where to write them: DIR/man/*.1 and DIR/completions/.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// `report` options.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The database an enforcer keeps (`enforce --state-db`).
    #[arg(long, value_name = "PATH")]
    pub state_db: PathBuf,
    /// How far back (e.g. 7d, 12h, 4weeks).
    #[arg(long, default_value = "7d", value_parser = parse_since, value_name = "DURATION")]
    pub since: Duration,
    /// One line per user or per host.
    #[arg(long, value_enum, default_value = "user")]
    pub by: ReportBy,
    #[arg(long, value_enum, default_value = "text")]
    pub output: ReportOutput,
}

/// What a report's lines are about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportBy {
    User,
    Host,
}

/// How a report is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportOutput {
    /// An aligned table.
    Text,
    /// One JSON array.
    Json,
    /// Comma-separated values with a header line.
    Csv,
}

/// `--since`: any duration (`7d`).
///
/// # Errors
/// Not a duration.
pub fn parse_since(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("not a duration such as 7d or 12h: {e}"))
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Text on stdout (enforce: genv's lines; doctor: a table); warnings
    /// and errors on stderr.
    Text,
    /// JSON on stdout (enforce: one object per cycle; doctor: one object).
    Json,
}

/// `enforce` options.
#[derive(Debug, Args)]
#[command(after_help = ENFORCE_EXAMPLES)]
pub struct EnforceArgs {
    #[command(flatten)]
    pub rules: RuleArgs,

    #[command(flatten)]
    pub cycle: CycleArgs,

    /// Read a recorded `genv usage snapshot` JSON instead of this machine
    /// (implies --dry-run). Several files are assessed one after the other.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub snapshot: Vec<PathBuf>,

    /// Deadline of each step on this machine (nvidia-smi, reading genv's
    /// state, a detach). genv's lock is waited for 1s at most: then the
    /// state is read, or a detach written, without it.
    #[arg(long, default_value = "30s", value_parser = parse_timeout, value_name = "DURATION")]
    pub command_timeout: Duration,
}

/// `remote` options: which hosts and how to reach them.
#[derive(Debug, Args)]
#[command(after_help = REMOTE_EXAMPLES)]
pub struct RemoteArgs {
    /// Comma-separated hosts, `[user@]host[:port]` (also `-host`)
    #[arg(short = 'H', long = "host", value_name = "HOSTS", group = "hosts")]
    pub host: Option<String>,

    /// A file with one host a line (blank and `#` lines ignored)
    #[arg(long, value_name = "FILE", group = "hosts")]
    pub hostfile: Option<PathBuf>,

    /// An inventory TOML (see hosts.example.toml)
    #[arg(long, value_name = "FILE", group = "hosts")]
    pub inventory: Option<PathBuf>,

    /// SSH login name for hosts that do not name one
    #[arg(short = 'l', long = "username", value_name = "USER")]
    pub username: Option<String>,

    /// SSH private key for hosts that do not name one (default: ssh's own)
    #[arg(long, value_name = "FILE")]
    pub identity_file: Option<PathBuf>,

    /// SSH connect timeout in seconds [default: 10]
    #[arg(short = 't', long = "timeout", value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=MAX_DURATION.as_secs()))]
    pub timeout: Option<u64>,

    /// Abort when any host fails (before anything is enforced)
    #[arg(short = 'e', long)]
    pub exit_on_error: bool,

    /// Do not print host failures
    #[arg(short = 'q', long)]
    pub quiet: bool,

    /// Hosts worked on at once, SSH handshakes included
    #[arg(long, default_value_t = 32, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrency: u16,

    /// Deadline of each remote command (a hung nvidia-smi or sudo fails that host for the cycle)
    #[arg(long, default_value = "30s", value_parser = parse_timeout, value_name = "DURATION")]
    pub command_timeout: Duration,

    /// Directory for the SSH master sockets [default: a private directory under
    /// $RUNTIME_DIRECTORY (the service's /run/genv-enforce), else under $TMPDIR]
    #[arg(long, value_name = "DIR")]
    pub control_dir: Option<PathBuf>,

    /// Leave the SSH masters running this long after the run, for the next
    /// run with the same --control-dir to use (cron: no handshake per run)
    #[arg(long, value_name = "DURATION", requires = "control_dir", value_parser = parse_timeout)]
    pub control_persist: Option<Duration>,

    /// Host-key policy
    #[arg(long, value_enum, default_value = "accept-new")]
    pub host_key_check: HostKeyCheck,

    /// known_hosts file to use instead of ~/.ssh/known_hosts
    #[arg(long, value_name = "FILE")]
    pub known_hosts_file: Option<PathBuf>,

    #[command(subcommand)]
    pub command: RemoteCommand,
}

/// How host keys are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HostKeyCheck {
    /// Only hosts already in known_hosts.
    Strict,
    /// Unknown hosts are added; changed keys are refused.
    AcceptNew,
}

/// What to do on the remote hosts.
#[derive(Debug, Subcommand)]
pub enum RemoteCommand {
    /// Enforce GPU usage on the hosts.
    Enforce(Box<RemoteEnforceArgs>),
    /// Check every host before enforcing: SSH, host key, sudo, Python,
    /// nvidia-smi, genv's state and version, tools, clock; a fix for each
    /// failure; exit status 1 if any host fails.
    Doctor(DoctorOutput),
}

/// `doctor`'s output.
#[derive(Debug, Args)]
pub struct DoctorOutput {
    /// Output format: a table, or one JSON object.
    #[arg(long, value_enum, default_value = "text")]
    pub output: OutputFormat,

    /// Also check etcd, the election and each host's fence.
    #[command(flatten)]
    pub ha: Box<HaArgs>,
}

/// `remote ... enforce` options.
#[derive(Debug, Args)]
pub struct RemoteEnforceArgs {
    #[command(flatten)]
    pub rules: RuleArgs,

    #[command(flatten)]
    pub cycle: CycleArgs,

    /// Replay a recorded fleet: one `<host>.json` (genv snapshot JSON) per
    /// host; the hosts are -H's, or every file in DIR. Implies --dry-run.
    #[arg(long, value_name = "DIR")]
    pub snapshot_dir: Option<PathBuf>,
}

/// genv accepts `-host`; clap has no single-dash long options.
pub fn normalize_args(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    args.into_iter()
        .map(|a| match a.to_str() {
            Some("-host") => "--host".into(),
            Some(s) if s.starts_with("-host=") => format!("-{s}").into(),
            _ => a,
        })
        .collect()
}

/// `doctor` (this machine) options.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub output: DoctorOutput,
    /// Deadline for each step.
    #[arg(long, default_value = "30s", value_parser = parse_timeout, value_name = "DURATION")]
    pub command_timeout: Duration,
}

/// `snapshot` options.
#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// Deadline of each step (nvidia-smi, reading genv's state). genv's
    /// lock is waited for 1s at most: then the state is read without it.
    #[arg(long, default_value = "30s", value_parser = parse_timeout, value_name = "DURATION")]
    pub command_timeout: Duration,
}

/// How cycles run, for `enforce` and `remote ... enforce` alike.
#[derive(Debug, Args)]
pub struct CycleArgs {
    /// Time between cycles: bare seconds as genv (`10`) or a duration
    /// (`30s`, `2m`); 0 runs one cycle and exits.
    #[arg(long, default_value = "10", value_parser = parse_duration, value_name = "INTERVAL")]
    pub interval: Duration,

    /// Report what would be done; terminate and detach nothing.
    #[arg(long)]
    pub dry_run: bool,

    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    pub output: OutputFormat,

    /// Append one JSON line per action to FILE, before the action, and one
    /// with its outcome after (created 0600; a symlink, or a file others
    /// may write, is refused).
    #[arg(long, value_name = "FILE")]
    pub audit_log: Option<PathBuf>,

    /// SIGKILL a terminated process still running (same identity) this long
    /// after its SIGTERM; the cycle waits that long [default: off, as genv].
    #[arg(long, value_parser = parse_timeout, value_name = "DURATION")]
    pub kill_after: Option<Duration>,

    /// Act on a violation only once it is seen in N cycles (same process
    /// and start time, or same environment and device; an absence its
    /// owner could cause does not start the count over).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub confirm_cycles: u32,

    /// Warn first: an action waits this long after its violation is first
    /// seen (its owner warned), and is carried out only if the violation
    /// still holds then (0: at once, as genv).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION", default_value = "0s")]
    pub grace: Duration,

    /// Keep each action's progress (warnings, deadlines), the jobs seen
    /// orphaned, events, actions and per-user usage in this SQLite file,
    /// across restarts (root's alone: 0600 in a 0700 directory).
    #[arg(long, value_name = "PATH")]
    pub state_db: Option<PathBuf>,

    /// How long --state-db keeps events, actions and usage.
    #[arg(long, value_parser = parse_retention, value_name = "DURATION", default_value = "90d")]
    pub retain: Duration,

    /// Serve Prometheus metrics on ADDR (e.g. 127.0.0.1:9400), path /metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,

    /// TLS and basic authentication of the metrics endpoint, from a web
    /// configuration file as Prometheus exporters read it (YAML:
    /// tls_server_config, basic_auth_users with bcrypt hashes)
    #[arg(
        long = "web.config.file",
        alias = "web-config-file",
        value_name = "FILE",
        requires = "metrics_listen"
    )]
    pub web_config_file: Option<PathBuf>,

    /// Serve each cycle's view (hosts, GPUs, jobs, users against their
    /// caps, what waits and what was done) on this Unix socket, for
    /// `status` and `top`: root's alone (0600) unless --view-group. The
    /// same JSON is at /view on --metrics-listen.
    #[arg(long, value_name = "PATH")]
    pub view_socket: Option<PathBuf>,

    /// The group whose members may read --view-socket (0660).
    #[arg(long, value_name = "GROUP", requires = "view_socket")]
    pub view_group: Option<String>,

    /// Mail each warning, action and clearing to the job's owner through
    /// this SMTP server: smtp://HOST:PORT (plain; add ?tls=required for
    /// STARTTLS) or smtps://HOST:PORT (implicit TLS). Not in a dry run.
    #[arg(long, value_name = "URL", help_heading = "Notifications")]
    pub smtp: Option<String>,

    /// The SMTP user name (first line) and password (second line); the
    /// file must be ours and readable by no one else.
    #[arg(long, value_name = "FILE", help_heading = "Notifications")]
    pub smtp_credentials: Option<PathBuf>,

    /// The mails' sender, e.g. 'GPU police <gpu-admin@example.edu>'.
    #[arg(long, value_name = "ADDR", help_heading = "Notifications")]
    pub mail_from: Option<String>,

    /// The owner's address, {user} standing for the user name (e.g.
    /// '{user}@example.edu'); the inventory's [users.NAME] email wins.
    #[arg(long, value_name = "TEMPLATE", help_heading = "Notifications")]
    pub mail_to: Option<String>,

    /// Copy every mail to ADDR too (repeatable).
    #[arg(long, value_name = "ADDR", help_heading = "Notifications")]
    pub mail_admin: Vec<String>,

    /// Post each warning, action and clearing as JSON to URL: a `text`
    /// that Slack and Mattermost incoming webhooks show, and the event.
    /// Not in a dry run. Any local user can read a command line: for a
    /// URL that holds a token, use --webhook-file.
    #[arg(long, value_name = "URL", help_heading = "Notifications")]
    pub webhook: Option<String>,

    /// As --webhook, the URL read from FILE (ours, readable by no one else).
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "webhook",
        help_heading = "Notifications"
    )]
    pub webhook_file: Option<PathBuf>,

    /// Tell the job's owner on the host too: a short message on the job's
    /// terminal and the owner's login terminals there, as write(1) does.
    #[arg(long, help_heading = "Notifications")]
    pub notify_terminal: bool,

    /// Per channel, each recipient gets at most N messages in any hour
    /// about their jobs, and N more about attachments none of their jobs
    /// uses (anyone can write those); a warning with a deadline about their
    /// jobs is never held back. Each process or environment gets at most 3
    /// messages an hour of each of those two kinds.
    #[arg(long, value_name = "N", default_value_t = 20, help_heading = "Notifications",
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub notify_rate: u32,

    /// A page for the users whose jobs are judged (your copy of the
    /// package's docs/users.md, on a web server or a shared path): its
    /// address closes every notification, beside the rule's why and what
    /// to do
    #[arg(long, value_name = "URL", help_heading = "Notifications", value_parser = parse_link)]
    pub notify_link: Option<String>,

    /// Refuse a host's genv state file holding more than N records
    /// (environments, their pids and kernel ids; devices and attachments):
    /// that host is degraded (only what needs no genv state is judged
    /// there; exit status 1), the others are enforced. Real state holds
    /// dozens.
    #[arg(long, default_value_t = crate::snapshot::genv::DEFAULT_MAX_RECORDS, value_name = "N",
          value_parser = parse_max_records)]
    pub max_records: usize,

    #[command(flatten)]
    pub ha: HaArgs,
}

/// High availability on etcd (`--ha-*`).
#[derive(Debug, Clone, Args)]
pub struct HaArgs {
    /// Run as one of several enforcer boxes on etcd: only the box whose
    /// lease holds the election key acts; the others report as a dry run
    /// and take over when that lease ends. etcd's client URLs,
    /// comma-separated (http://10.0.0.1:2379,...; https:// with
    /// --ha-cacert).
    #[arg(long, value_name = "URL", value_delimiter = ',', num_args = 1.., help_heading = "High availability")]
    pub ha_etcd: Vec<String>,

    /// The prefix of our etcd keys: boxes that share it (and --shard)
    /// elect one leader.
    #[arg(long, value_name = "PREFIX", default_value = crate::ha::DEFAULT_KEY, help_heading = "High availability")]
    pub ha_key: String,

    /// Enforce shard K of N: the hosts at places K, K+N, K+2N, ... of the
    /// inventory (from 1). The per-user device caps still count every
    /// shard's hosts (each shard publishes its part in etcd) and detach
    /// in one global order, each shard on its own hosts.
    #[arg(long, value_name = "K/N", help_heading = "High availability")]
    pub shard: Option<crate::ha::Shard>,

    /// This box's name in the election (what the others report as the
    /// leader) [default: the hostname].
    #[arg(long, value_name = "NAME", help_heading = "High availability")]
    pub ha_name: Option<String>,

    /// The lease's time to live: a leader that stops keeping it alive
    /// (dead, paused, cut off) is replaced this long after [default: three
    /// intervals, at least 3s; 30s with --interval 0].
    #[arg(long, value_name = "DURATION", value_parser = parse_ha_ttl, help_heading = "High availability")]
    pub ha_ttl: Option<Duration>,

    /// Where each host's agent keeps the highest leader epoch it has seen
    /// (a directory of root's alone, made if missing; an action with an
    /// older epoch is refused there).
    #[arg(long, value_name = "DIR", default_value = crate::ha::FENCE_DIR, help_heading = "High availability")]
    pub ha_fence_dir: String,

    /// The CA certificate (PEM) that signs etcd's server certificates.
    #[arg(long, value_name = "FILE", help_heading = "High availability")]
    pub ha_cacert: Option<PathBuf>,

    /// Our client certificate (PEM), for etcd's --client-cert-auth.
    #[arg(
        long,
        value_name = "FILE",
        requires = "ha_cacert",
        requires = "ha_cert_key",
        help_heading = "High availability"
    )]
    pub ha_cert: Option<PathBuf>,

    /// The key (PEM) of --ha-cert.
    #[arg(
        long,
        value_name = "FILE",
        requires = "ha_cert",
        help_heading = "High availability"
    )]
    pub ha_cert_key: Option<PathBuf>,

    /// etcd's user (auth enabled); its password is read from
    /// --ha-password-file.
    #[arg(
        long,
        value_name = "USER",
        requires = "ha_password_file",
        help_heading = "High availability"
    )]
    pub ha_user: Option<String>,

    /// The file holding --ha-user's password (ours, readable by no one
    /// else).
    #[arg(
        long,
        value_name = "FILE",
        requires = "ha_user",
        help_heading = "High availability"
    )]
    pub ha_password_file: Option<PathBuf>,
}

/// `--ha-ttl`: from 2s (etcd's floor) to an hour.
fn parse_ha_ttl(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d < Duration::from_secs(2) || d > Duration::from_secs(3600) {
        return Err(format!("{text} is not between 2s and 1h"));
    }
    Ok(d)
}

/// `--notify-link`: one line of printable text, at most 512 bytes.
fn parse_link(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("empty".into());
    }
    if s.len() > 512 {
        return Err("longer than 512 bytes".into());
    }
    if s.chars().any(char::is_control) {
        return Err("a control character in it".into());
    }
    Ok(s.to_string())
}

/// `--max-records`: at least 1, at most 10 million (work on a host's
/// state is linear, but unbounded work on what users write is not).
fn parse_max_records(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=10_000_000).contains(&n) => Ok(n),
        _ => Err("a number of records from 1 to 10000000".into()),
    }
}

/// genv's rule flags.
#[derive(Debug, Args)]
#[command(next_help_heading = "Enforcements")]
pub struct RuleArgs {
    /// Terminate processes that are not running in a GPU environment [default: off]
    #[arg(long, conflicts_with = "no_non_env_processes")]
    pub non_env_processes: bool,
    /// Do not terminate processes outside environments
    #[arg(long)]
    pub no_non_env_processes: bool,

    /// Enforce environment attached devices [default: on]
    #[arg(long, conflicts_with = "no_env_devices")]
    pub env_devices: bool,
    /// Do not enforce attached devices
    #[arg(long)]
    pub no_env_devices: bool,

    /// Enforce environment memory capacity if set [default: on]
    #[arg(long, conflicts_with = "no_env_memory")]
    pub env_memory: bool,
    /// Do not enforce memory capacity
    #[arg(long)]
    pub no_env_memory: bool,

    /// Maximum allowed attached devices for each user
    #[arg(long, value_name = "N")]
    pub max_devices_per_user: Option<u32>,

    /// Per-user maximum of attached devices, overriding the above (applies
    /// on its own too, unlike genv)
    #[arg(long, num_args = 1.., value_name = "USERNAME=MAXIMUM", value_parser = parse_user_cap)]
    pub max_devices_for_user: Vec<(String, u32)>,

    /// Maximum GPU memory each user's processes may hold over all hosts,
    /// in genv's spelling (32gi, 40000mi); the youngest processes are
    /// terminated until under [default: off]
    #[arg(long, value_name = "SIZE", value_parser = parse_memory, help_heading = "Admin rules")]
    pub max_memory_per_user: Option<u64>,

    /// Per-user maximum GPU memory, overriding the above (applies on its
    /// own too)
    #[arg(long, num_args = 1.., value_name = "USERNAME=SIZE", value_parser = parse_user_memory, help_heading = "Admin rules")]
    pub max_memory_for_user: Vec<(String, u64)>,

    /// Maximum attached devices the members of a Unix group hold together
    /// over all hosts (groups resolved on each host)
    #[arg(long, num_args = 1.., value_name = "GROUP=MAXIMUM", value_parser = parse_group_cap, help_heading = "Admin rules")]
    pub max_devices_per_group: Vec<(String, u32)>,

    /// Terminate a process that holds GPU memory while its utilization
    /// stays below --idle-below for this long (4h, 90m; 0s: at one
    /// reading) [default: off]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Admin rules")]
    pub idle_after: Option<Duration>,

    /// Below this GPU utilization (percent) a process is idle
    #[arg(long, value_name = "PCT", default_value_t = 5, requires = "idle_after",
          value_parser = clap::value_parser!(u32).range(1..=100), help_heading = "Admin rules")]
    pub idle_below: u32,

    /// Under --non-env-processes, also terminate a GPU job whose
    /// GENV_ENVIRONMENT_ID names no environment (made up, or its record
    /// gone), once this grace has passed since it was first seen, its owner
    /// warned meanwhile (genv leaves such jobs alone) [default: off]
    #[arg(long, value_name = "GRACE", value_parser = parse_duration, requires = "non_env_processes",
          help_heading = "Admin rules")]
    pub orphans_as_non_env: Option<Duration>,

    /// Count the devices of a user's GPU jobs outside genv toward their
    /// device cap (genv counts attached devices only) [default: off]
    #[arg(long, help_heading = "Admin rules")]
    pub count_non_env_devices: bool,
}

impl RuleArgs {
    /// The rules' own graces the flags set.
    pub fn graces(
        &self,
    ) -> std::collections::BTreeMap<crate::rules::Rule, crate::ladder::RuleGrace> {
        self.orphans_as_non_env
            .map(|after| {
                (
                    crate::rules::Rule::OrphanedEnvProcesses,
                    crate::ladder::RuleGrace {
                        warn_only: false,
                        after: Some(after),
                    },
                )
            })
            .into_iter()
            .collect()
    }
}

/// A memory amount in genv's spelling, in bytes.
///
/// # Errors
/// Not one.
pub fn parse_memory(text: &str) -> Result<u64, String> {
    crate::snapshot::memory::parse(text).map_err(|e| format!("{e} (such as 32gi or 40000mi)"))
}

/// `username=size`.
///
/// # Errors
/// No `=`, an empty name, or not a memory amount.
pub fn parse_user_memory(text: &str) -> Result<(String, u64), String> {
    let (user, size) = text
        .split_once('=')
        .ok_or_else(|| format!("not a valid spec: {text} (expected USERNAME=SIZE)"))?;
    if user.is_empty() {
        return Err(format!("not a valid spec: {text} (empty username)"));
    }
    Ok((user.to_string(), parse_memory(size)?))
}

/// `group=maximum`.
///
/// # Errors
/// As [`parse_user_cap`], for a group.
pub fn parse_group_cap(text: &str) -> Result<(String, u32), String> {
    parse_user_cap(text).map_err(|e| {
        e.replace("USERNAME", "GROUP")
            .replace("username", "group name")
    })
}

/// The longest duration any flag accepts: longer is surely a typo, and
/// keeps every sum of durations far from overflowing.
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Seconds as a bare integer (genv) or a humantime duration, at most
/// [`MAX_DURATION`].
///
/// # Errors
/// Neither form, or longer than [`MAX_DURATION`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let d = match text.parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => humantime::parse_duration(text)
            .map_err(|e| format!("not seconds nor a duration such as 30s or 2m: {e}"))?,
    };
    if d > MAX_DURATION {
        return Err(format!(
            "{text} is longer than the maximum of {}",
            humantime::format_duration(MAX_DURATION)
        ));
    }
    Ok(d)
}

/// A retention (`--retain`): a duration such as `90d`, from an hour to
/// ten years.
///
/// # Errors
/// Not a duration, or outside that range.
pub fn parse_retention(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text)
        .map_err(|e| format!("not a duration such as 90d or 12weeks: {e}"))?;
    if d < Duration::from_secs(3600) || d > Duration::from_secs(10 * 366 * 86400) {
        return Err(format!("{text} is not between 1h and 10 years"));
    }
    Ok(d)
}

/// A deadline: as [`parse_duration`], and at least one second (host-side
/// limits count whole seconds).
///
/// # Errors
/// As [`parse_duration`], or shorter than a second.
pub fn parse_timeout(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d < Duration::from_secs(1) {
        return Err(format!("{text} is shorter than the minimum of 1s"));
    }
    Ok(d)
}

/// `username=maximum`.
///
/// # Errors
/// No `=`, an empty name, or a maximum that is not a non-negative integer.
pub fn parse_user_cap(text: &str) -> Result<(String, u32), String> {
    let (user, max) = text
        .split_once('=')
        .ok_or_else(|| format!("not a valid spec: {text} (expected USERNAME=MAXIMUM)"))?;
    if user.is_empty() {
        return Err(format!("not a valid spec: {text} (empty username)"));
    }
    let max = max.parse().map_err(|_| {
        format!("not a valid spec: {text} (maximum must be a non-negative integer)")
    })?;
    Ok((user.to_string(), max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notify_link_is_one_printable_line_of_at_most_512_bytes() {
        let url = "https://gpu.example.edu/users.html";
        assert_eq!(parse_link(url), Ok(url.to_string()));
        let longest = "x".repeat(512);
        assert_eq!(parse_link(&longest), Ok(longest.clone()));
        for bad in [
            String::new(),
            "  ".into(),
            "a\nb".into(),
            "a\u{1b}[2J".into(),
            "x".repeat(513),
        ] {
            assert!(parse_link(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn retention_is_an_hour_to_ten_years() {
        assert_eq!(parse_retention("90d"), Ok(Duration::from_secs(90 * 86400)));
        assert_eq!(parse_retention("1h"), Ok(Duration::from_secs(3600)));
        for bad in ["59m", "11years", "soon", "90"] {
            assert!(parse_retention(bad).is_err(), "{bad}");
        }
        assert!(parse_retention("10years").is_ok());
    }
    use crate::rules::Policy;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("genv-enforce").chain(args.iter().copied()))
    }

    fn policy(args: &[&str]) -> Policy {
        match parse(args).unwrap().command {
            Command::Enforce(e) => crate::config::policy(&e.rules),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn genv_defaults_and_flags() {
        assert_eq!(policy(&["enforce"]), Policy::default());
        let p = policy(&[
            "enforce",
            "--non-env-processes",
            "--no-env-devices",
            "--max-devices-per-user",
            "2",
            "--max-devices-for-user",
            "alice=1",
            "bob=0",
            "--interval",
            "0",
        ]);
        assert!(p.non_env_processes && !p.env_devices && p.env_memory);
        assert_eq!(p.max_devices_per_user, Some(2));
        assert_eq!(p.max_devices_for_user.get("bob"), Some(&0));
    }

    #[test]
    fn interval_forms() {
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("18446744073709551615").is_err());
        assert!(parse_duration("31days").is_err());
        assert_eq!(parse_duration("30days"), Ok(MAX_DURATION));
        assert!(parse_timeout("0").is_err() && parse_timeout("500ms").is_err());
        assert_eq!(parse_timeout("1"), Ok(Duration::from_secs(1)));
    }

    #[test]
    fn genvs_single_dash_host_in_both_spellings() {
        let args = |a: &[&str]| normalize_args(a.iter().map(std::ffi::OsString::from));
        assert_eq!(args(&["x", "-host", "a,b"]), args(&["x", "--host", "a,b"]));
        assert_eq!(args(&["x", "-host=a,b"]), args(&["x", "--host=a,b"]));
        assert_eq!(
            args(&["x", "-hostile"]),
            args(&["x", "-hostile"]),
            "only -host itself"
        );
    }

    #[test]
    fn remote_command_line_as_genv() {
        let args = normalize_args(
            [
                "genv-enforce",
                "remote",
                "-host",
                "a,b",
                "-l",
                "ops",
                "-t",
                "5",
                "-e",
                "-q",
                "enforce",
                "--max-devices-per-user",
                "2",
            ]
            .map(std::ffi::OsString::from),
        );
        let Command::Remote(r) = Cli::try_parse_from(args).unwrap().command else {
            panic!()
        };
        assert_eq!(
            (r.host.as_deref(), r.username.as_deref(), r.timeout),
            (Some("a,b"), Some("ops"), Some(5))
        );
        assert!(r.exit_on_error && r.quiet);
        let RemoteCommand::Enforce(e) = r.command else {
            panic!("not enforce")
        };
        assert_eq!(
            crate::config::policy(&e.rules).max_devices_per_user,
            Some(2)
        );
        assert!(parse(&["remote", "-H", "a", "--hostfile", "f", "enforce"]).is_err());
        assert!(parse(&["remote", "-H", "a", "--concurrency", "0", "enforce"]).is_err());
        for t in ["0", "18446744073709551615", "-1"] {
            assert!(
                parse(&["remote", "-H", "a", "-t", t, "enforce"]).is_err(),
                "{t}"
            );
        }
    }

    #[test]
    fn bad_flags_are_errors() {
        assert!(parse(&["enforce", "--env-devices", "--no-env-devices"]).is_err());
        assert!(parse(&["enforce", "--max-devices-for-user", "alice"]).is_err());
        assert!(parse(&["enforce", "--max-devices-for-user", "=1"]).is_err());
        assert!(parse(&["enforce", "--max-devices-per-user", "-1"]).is_err());
        assert!(parse(&["enforce", "--interval", "x"]).is_err());
        assert!(parse(&["enforce", "--output", "xml"]).is_err());
    }
}
