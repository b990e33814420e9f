//! Which hosts to enforce and how to reach each: `-H h1,h2`, `--hostfile`
//! (genv's formats) or an inventory TOML (see `hosts.example.toml`).
//! Pure: text in, [`HostSpec`]s out; reading the files is the caller's.

use crate::ladder::{Exemption, RuleGrace};
use crate::rules::Rule;
use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;
use thiserror::Error;
use toml::Spanned;

pub use crate::host::ssh::HostSpec;
use crate::model::HostId;

/// Per-user device caps read from an inventory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caps {
    pub max_devices_per_user: Option<u32>,
    pub max_devices_for_user: BTreeMap<String, u32>,
}

/// A fleet: hosts in order, and caps and rules' graces from the
/// inventory file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inventory {
    pub hosts: Vec<HostSpec>,
    pub caps: Caps,
    pub policy: BTreeMap<Rule, RuleGrace>,
    pub exempt: Vec<Exemption>,
    /// `[users.<name>] email`: each user's mail address.
    pub emails: BTreeMap<String, String>,
}

/// An inventory that cannot be used, naming the file and where.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{file}: {message}")]
pub struct InventoryError {
    pub file: String,
    pub message: String,
}

/// Declares a TOML table type carrying every host setting inline (serde's
/// `flatten` would lose toml's line numbers and key names in errors), each
/// value with its place in the file for the checks serde cannot make.
macro_rules! with_settings {
    ($(#[$m:meta])* struct $name:ident { $($field:ident: $ty:ty,)* }) => {
        $(#[$m])*
        struct $name {
            $($field: $ty,)*
            user: Option<Spanned<String>>,
            port: Option<Spanned<u16>>,
            identity_file: Option<Spanned<PathBuf>>,
            ssh_options: Option<Spanned<Vec<String>>>,
            genv_dir: Option<Spanned<String>>,
            sudo: Option<Spanned<String>>,
            python: Option<Spanned<String>>,
            /// Accepted and ignored: detaches no longer run genv on the host.
            #[allow(dead_code)]
            genv: Option<Spanned<String>>,
            nvidia_smi: Option<Spanned<String>>,
        }

        impl $name {
            /// The settings of this table, checked.
            fn settings(&self) -> Result<Settings, Located> {
                let non_empty = |key: &str, v: &Option<Spanned<String>>| match v {
                    Some(v) if v.get_ref().trim().is_empty() => {
                        Err(Located::at(v, format!("key `{key}`: must not be empty")))
                    }
                    _ => Ok(v.as_ref().map(|v| v.get_ref().clone())),
                };
                if let Some(port) = self.port.as_ref().filter(|p| *p.get_ref() == 0) {
                    return Err(Located::at(port, "key `port`: must be 1-65535".into()));
                }
                if let Some(options) = &self.ssh_options {
                    if let Some(o) = options
                        .get_ref()
                        .iter()
                        .find(|o| !o.contains('=') || o.starts_with('='))
                    {
                        return Err(Located::at(
                            options,
                            format!("key `ssh_options`: {o:?} is not Key=Value"),
                        ));
                    }
                }
                Ok(Settings {
                    user: non_empty("user", &self.user)?,
                    port: self.port.as_ref().map(|p| *p.get_ref()),
                    identity_file: self.identity_file.as_ref().map(|f| f.get_ref().clone()),
                    ssh_options: self.ssh_options.as_ref().map(|o| o.get_ref().clone()),
                    genv_dir: non_empty("genv_dir", &self.genv_dir)?,
                    sudo: self.sudo.as_ref().map(|s| s.get_ref().clone()),
                    python: non_empty("python", &self.python)?,
                    nvidia_smi: non_empty("nvidia_smi", &self.nvidia_smi)?,
                })
            }
        }
    };
}

/// A problem at a byte offset of the inventory text.
struct Located {
    offset: usize,
    message: String,
}

impl Located {
    fn at<T>(value: &Spanned<T>, message: String) -> Self {
        Located {
            offset: value.span().start,
            message,
        }
    }
}

/// Settings a host inherits from `[defaults]` and its group.
#[derive(Debug, Clone, Default)]
struct Settings {
    user: Option<String>,
    port: Option<u16>,
    identity_file: Option<PathBuf>,
    ssh_options: Option<Vec<String>>,
    genv_dir: Option<String>,
    sudo: Option<String>,
    python: Option<String>,
    nvidia_smi: Option<String>,
}

impl Settings {
    /// `self` with gaps filled from `base`.
    fn over(&self, base: &Settings) -> Settings {
        Settings {
            user: self.user.clone().or_else(|| base.user.clone()),
            port: self.port.or(base.port),
            identity_file: self
                .identity_file
                .clone()
                .or_else(|| base.identity_file.clone()),
            ssh_options: self
                .ssh_options
                .clone()
                .or_else(|| base.ssh_options.clone()),
            genv_dir: self.genv_dir.clone().or_else(|| base.genv_dir.clone()),
            sudo: self.sudo.clone().or_else(|| base.sudo.clone()),
            python: self.python.clone().or_else(|| base.python.clone()),
            nvidia_smi: self.nvidia_smi.clone().or_else(|| base.nvidia_smi.clone()),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    defaults: Defaults,
    #[serde(default)]
    group: Vec<Group>,
    #[serde(default)]
    host: Vec<HostEntry>,
    #[serde(default)]
    limits: Limits,
    /// `[policy.<rule>]`, by genv's rule names.
    #[serde(default)]
    policy: BTreeMap<String, RulePolicy>,
    /// `[[exempt]]`.
    #[serde(default)]
    exempt: Vec<ExemptEntry>,
    /// `[users.<name>]`: what the inventory knows of a user.
    #[serde(default)]
    users: BTreeMap<String, UserEntry>,
}

/// `[users.<name>]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UserEntry {
    /// Where their notifications are mailed.
    email: Option<String>,
}

/// `[[exempt]]`: actions on a user's jobs, on a host, within a window.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExemptEntry {
    user: Option<Spanned<String>>,
    group: Option<Spanned<String>>,
    host: Option<Spanned<String>>,
    from: Option<Spanned<String>>,
    until: Option<Spanned<String>>,
    reason: Option<String>,
}

/// `[policy.<rule>]`: how one rule's actions are carried out.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RulePolicy {
    /// `warn` (never acted on) or `enforce`.
    action: Option<Spanned<String>>,
    /// Its grace (`15m`), instead of `--grace`.
    grace: Option<Spanned<String>>,
}

with_settings! {
    /// `[defaults]`.
    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Defaults {}
}

with_settings! {
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Group {
        name: Spanned<String>,
        hosts: Option<Vec<Spanned<String>>>,
    }
}

with_settings! {
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct HostEntry {
        name: Spanned<String>,
        address: Option<Spanned<String>>,
        group: Option<Spanned<String>>,
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limits {
    max_devices_per_user: Option<u32>,
    #[serde(default)]
    max_devices_for_user: BTreeMap<String, u32>,
}

/// Options that apply to every host (`-l`, and genv's defaults).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `-l USER`: login name for hosts that do not name one.
    pub user: Option<String>,
}

use crate::snapshot::genv::DEFAULT_DIR as DEFAULT_GENV_DIR;

fn spec(id: &str, address: &str, s: &Settings) -> Result<HostSpec, String> {
    // A command as shell words (quotes allowed), never empty where required.
    let words = |key: &str, v: &Option<String>, default: &str, required: bool| {
        let words = shell_words::split(v.as_deref().unwrap_or(default))
            .map_err(|e| format!("key `{key}`: {e}"))?;
        if required && words.is_empty() {
            return Err(format!("key `{key}`: must not be empty"));
        }
        Ok::<_, String>(words)
    };
    if address.is_empty() || address.starts_with('-') || address.contains(char::is_whitespace) {
        return Err(format!("bad address {address:?}"));
    }
    Ok(HostSpec {
        id: HostId::new(id)?,
        address: address.to_string(),
        user: s.user.clone(),
        port: s.port,
        identity_file: s.identity_file.clone(),
        ssh_options: s.ssh_options.clone().unwrap_or_default(),
        genv_dir: s
            .genv_dir
            .clone()
            .unwrap_or_else(|| DEFAULT_GENV_DIR.to_string()),
        sudo: words("sudo", &s.sudo, "sudo -n", false)?,
        python: words("python", &s.python, "python3", true)?,
        nvidia_smi: words("nvidia_smi", &s.nvidia_smi, "nvidia-smi", true)?,
    })
}

/// Parses genv's host notation `[user@]host[:port]` (IPv6 as `[addr]:port`).
///
/// # Errors
/// An empty host, user or port, or a port that is not 1-65535.
pub fn parse_host(text: &str, overrides: &Overrides) -> Result<HostSpec, String> {
    let (user, rest) = match text.rsplit_once('@') {
        Some((u, r)) if !u.is_empty() => (Some(u.to_string()), r),
        Some(_) => return Err(format!("{text:?}: empty user")),
        None => (overrides.user.clone(), text),
    };
    let (address, port) = if let Some(inner) = rest.strip_prefix('[') {
        let (addr, after) = inner
            .split_once(']')
            .ok_or_else(|| format!("{text:?}: unclosed ["))?;
        (addr, after.strip_prefix(':'))
    } else if rest.matches(':').count() == 1 {
        let (a, p) = rest.split_once(':').unwrap_or((rest, ""));
        (a, Some(p))
    } else {
        (rest, None)
    };
    if address.is_empty() {
        return Err(format!("{text:?}: empty host"));
    }
    let port = match port {
        Some(p) => Some(
            p.parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("{text:?}: bad port {p:?}"))?,
        ),
        None => None,
    };
    let settings = Settings {
        user,
        port,
        ..Settings::default()
    };
    spec(text, address, &settings)
}

/// What makes two entries the same machine: the address (case
/// insensitive) and the port. Two entries with the same key would be
/// snapshotted twice and their devices counted twice toward a user's cap.
fn machine(h: &HostSpec) -> (String, u16) {
    (h.address.to_ascii_lowercase(), h.port.unwrap_or(22))
}

/// The first entry that names the same machine as an earlier one (same
/// name, or same address and port), with that earlier one.
fn repeated(hosts: &[HostSpec]) -> Option<(&HostSpec, &HostSpec)> {
    hosts.iter().enumerate().find_map(|(i, h)| {
        hosts[..i]
            .iter()
            .find(|e| e.id == h.id || machine(e) == machine(h))
            .map(|e| (e, h))
    })
}

/// Why two entries may not both be enforced.
fn repeated_message(first: &HostSpec, again: &HostSpec) -> String {
    let (address, port) = machine(again);
    if first.id == again.id {
        format!("host `{}` is listed twice", again.id)
    } else {
        format!(
            "hosts `{}` and `{}` are the same machine ({address}, port {port}): its devices would count twice",
            first.id, again.id
        )
    }
}

/// Parses `-H h1,h2,...`.
///
/// # Errors
/// A bad host, a machine named twice, or no host at all.
pub fn parse_host_list(text: &str, overrides: &Overrides) -> Result<Vec<HostSpec>, String> {
    let hosts: Vec<HostSpec> = text
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| parse_host(h, overrides))
        .collect::<Result<_, _>>()?;
    if hosts.is_empty() {
        return Err("no hosts given".into());
    }
    if let Some((first, again)) = repeated(&hosts) {
        return Err(repeated_message(first, again));
    }
    Ok(hosts)
}

/// Parses a genv hostfile: one host a line; blank and `#` lines ignored.
///
/// # Errors
/// A bad host, or a machine named twice, naming the line.
pub fn parse_hostfile(
    text: &str,
    file: &str,
    overrides: &Overrides,
) -> Result<Vec<HostSpec>, InventoryError> {
    let err = |n: usize, m: String| InventoryError {
        file: file.to_string(),
        message: format!("line {n}: {m}"),
    };
    let mut hosts = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
    {
        hosts.push(parse_host(line, overrides).map_err(|m| err(n, m))?);
        if let Some((first, again)) = repeated(&hosts) {
            return Err(err(n, repeated_message(first, again)));
        }
    }
    Ok(hosts)
}

/// Parses an inventory TOML. Hosts come in file order: each `[[group]]`'s
/// `hosts`, then each `[[host]]`. A `[[host]]` may name a `group` to
/// inherit its settings; settings resolve host > group > `[defaults]`.
///
/// # Errors
/// TOML syntax, unknown keys, wrong types (with line and column), an
/// unknown group, a host listed twice, or a bad setting (naming the key).
pub fn parse_inventory(
    text: &str,
    file: &str,
    overrides: &Overrides,
) -> Result<Inventory, InventoryError> {
    let err = |message: String| InventoryError {
        file: file.to_string(),
        message,
    };
    let located = |e: Located| {
        let line = text[..e.offset.min(text.len())].matches('\n').count() + 1;
        err(format!("line {line}: {}", e.message))
    };
    let parsed: File =
        toml::from_str(text).map_err(|e| err(e.to_string().trim_end().replace('\n', "\n  ")))?;
    let defaults = parsed
        .defaults
        .settings()
        .map_err(located)?
        .over(&Settings {
            user: overrides.user.clone(),
            ..Settings::default()
        });
    let mut groups: Vec<(&str, Settings)> = Vec::new();
    for g in &parsed.group {
        let name = g.name.get_ref();
        if groups.iter().any(|(n, _)| n == name) {
            return Err(located(Located::at(
                &g.name,
                format!("[[group]] `{name}` is defined twice"),
            )));
        }
        groups.push((name, g.settings().map_err(located)?.over(&defaults)));
    }
    let mut hosts: Vec<HostSpec> = Vec::new();
    let mut push = |name: &Spanned<String>, address: &str, s: &Settings| {
        let h = spec(name.get_ref(), address, s)
            .map_err(|m| Located::at(name, format!("host `{}`: {m}", name.get_ref())))?;
        hosts.push(h);
        match repeated(&hosts) {
            Some((first, again)) => Err(Located::at(name, repeated_message(first, again))),
            None => Ok(()),
        }
    };
    for (g, (_, settings)) in parsed.group.iter().zip(&groups) {
        for name in g.hosts.iter().flatten() {
            push(name, name.get_ref(), settings).map_err(located)?;
        }
    }
    for h in &parsed.host {
        let base = match &h.group {
            Some(name) => groups
                .iter()
                .find(|(n, _)| n == name.get_ref())
                .map(|(_, s)| s)
                .ok_or_else(|| {
                    located(Located::at(
                        name,
                        format!(
                            "[[host]] `{}`: key `group`: unknown group `{}`",
                            h.name.get_ref(),
                            name.get_ref()
                        ),
                    ))
                })?,
            None => &defaults,
        };
        let address = h.address.as_ref().map_or(h.name.get_ref(), |a| a.get_ref());
        let settings = h.settings().map_err(located)?.over(base);
        push(&h.name, address, &settings).map_err(located)?;
    }
    if hosts.is_empty() {
        return Err(err(
            "no hosts: add [[host]] entries or a [[group]] with `hosts`".into(),
        ));
    }
    let mut policy = BTreeMap::new();
    for (name, p) in &parsed.policy {
        let rule = Rule::from_name(name).ok_or_else(|| {
            let names: Vec<&str> = Rule::ALL.iter().map(|r| r.name()).collect();
            err(format!(
                "[policy.{name}]: unknown rule ({})",
                names.join(", ")
            ))
        })?;
        let warn_only = match p.action.as_ref() {
            None => false,
            Some(a) => match a.get_ref().as_str() {
                "warn" => true,
                "enforce" => false,
                other => {
                    return Err(located(Located::at(
                        a,
                        format!(
                        "[policy.{name}]: key `action`: `{other}` is neither `warn` nor `enforce`"
                    ),
                    )))
                }
            },
        };
        let after = match p.grace.as_ref() {
            None => None,
            Some(g) => Some(crate::cli::parse_duration(g.get_ref()).map_err(|m| {
                located(Located::at(g, format!("[policy.{name}]: key `grace`: {m}")))
            })?),
        };
        policy.insert(rule, RuleGrace { warn_only, after });
    }
    let mut exempt = Vec::new();
    for (n, e) in parsed.exempt.iter().enumerate() {
        let n = n + 1;
        let at = |v: &Spanned<String>, m: String| {
            located(Located::at(v, format!("[[exempt]] #{n}: {m}")))
        };
        if let Some(g) = &e.group {
            let name = g.get_ref();
            if name.is_empty() || name.chars().any(char::is_control) {
                return Err(at(g, "key `group`: not a group name".into()));
            }
        }
        if e.user.is_none() && e.host.is_none() && e.group.is_none() {
            return Err(err(format!(
                "[[exempt]] #{n}: name a `user`, a `group` or a `host` (an exemption of everything is --dry-run)"
            )));
        }
        let time = |v: &Option<Spanned<String>>, key: &str| match v {
            None => Ok(None),
            Some(t) => humantime::parse_rfc3339_weak(t.get_ref())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| Some(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
                .ok_or_else(|| {
                    at(
                        t,
                        format!("key `{key}`: not a time such as 2026-11-23T08:00:00Z"),
                    )
                }),
        };
        let (from_ms, until_ms) = (time(&e.from, "from")?, time(&e.until, "until")?);
        if let (Some(f), Some(u), Some(v)) = (from_ms, until_ms, &e.until) {
            if u <= f {
                return Err(at(v, "key `until`: not after `from`".into()));
            }
        }
        let host = match &e.host {
            Some(h) => {
                Some(HostId::new(h.get_ref()).map_err(|m| at(h, format!("key `host`: {m}")))?)
            }
            None => None,
        };
        if let Some(h) = &host {
            if !hosts.iter().any(|s| &s.id == h) {
                return Err(at(
                    e.host.as_ref().expect("a host was given"),
                    format!("key `host`: `{h}` is no host of this inventory"),
                ));
            }
        }
        exempt.push(Exemption {
            user: e.user.as_ref().map(|u| u.get_ref().clone()),
            group: e.group.as_ref().map(|g| g.get_ref().clone()),
            host,
            from_ms,
            until_ms,
            reason: e
                .reason
                .clone()
                .unwrap_or_else(|| "exempt in the inventory".into()),
        });
    }
    let emails = parsed
        .users
        .into_iter()
        .filter_map(|(name, u)| Some((name, u.email?)))
        .collect();
    Ok(Inventory {
        hosts,
        policy,
        exempt,
        emails,
        caps: Caps {
            max_devices_per_user: parsed.limits.max_devices_per_user,
            max_devices_for_user: parsed.limits.max_devices_for_user,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn genv_host_notation() {
        let o = Overrides {
            user: Some("admin".into()),
        };
        let h = parse_host("alice@gpu1:2222", &o).unwrap();
        assert_eq!(
            (h.user.as_deref(), h.address.as_str(), h.port),
            (Some("alice"), "gpu1", Some(2222))
        );
        assert_eq!(h.id, HostId("alice@gpu1:2222".into()));
        let h = parse_host("gpu2", &o).unwrap();
        assert_eq!((h.user.as_deref(), h.port), (Some("admin"), None));
        assert_eq!(h.sudo, vec!["sudo", "-n"]);
        let h = parse_host("[::1]:22", &Overrides::default()).unwrap();
        assert_eq!((h.address.as_str(), h.port), ("::1", Some(22)));
        assert_eq!(
            parse_host("fe80::1", &Overrides::default()).unwrap().port,
            None
        );
        for bad in [
            "",
            "@gpu",
            "gpu:0",
            "gpu:x",
            "gpu:70000",
            "[::1",
            "-oProxyCommand=x",
            "a b",
        ] {
            assert!(parse_host(bad, &o).is_err(), "{bad}");
        }
        assert_eq!(parse_host_list("a, b,,c", &o).unwrap().len(), 3);
        assert!(parse_host_list(" , ", &o).is_err());
    }

    #[test]
    fn a_machine_named_twice_is_an_error() {
        let o = Overrides::default();
        for (list, why) in [
            ("gpu1,gpu1", "host `gpu1` is listed twice"),
            (
                "gpu1,alice@gpu1",
                "`gpu1` and `alice@gpu1` are the same machine (gpu1, port 22)",
            ),
            ("gpu1:2222,GPU1:2222", "same machine (gpu1, port 2222)"),
            ("gpu1:22,gpu1", "same machine"),
        ] {
            let e = parse_host_list(list, &o).unwrap_err();
            assert!(e.contains(why), "{list}: {e}");
        }
        assert_eq!(parse_host_list("gpu1,gpu1:2222", &o).unwrap().len(), 2);
        let e = parse_hostfile("gpu1\n# c\n\nops@gpu1\n", "hosts.txt", &o).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("hosts.txt: line 4: hosts `gpu1` and `ops@gpu1`"),
            "{e}"
        );
        let e = parse_inventory(
            "[[host]]\nname = \"a\"\naddress = \"10.0.0.1\"\n[[host]]\nname = \"b\"\naddress = \"10.0.0.1\"\n",
            "inv.toml",
            &o,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("line 5: hosts `a` and `b` are the same machine"),
            "{e}"
        );
    }

    #[test]
    fn hostfile() {
        let hosts = parse_hostfile(
            "# fleet\n\ngpu1\n  bob@gpu2:22 \n",
            "hosts.txt",
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(hosts.len(), 2);
        let e = parse_hostfile("gpu1\ngpu2:x\n", "hosts.txt", &Overrides::default()).unwrap_err();
        assert!(e.to_string().starts_with("hosts.txt: line 2:"), "{e}");
    }

    #[test]
    fn dash_l_names_the_user_where_the_inventory_does_not() {
        let o = Overrides {
            user: Some("ops".into()),
        };
        let inv = parse_inventory(
            "[[host]]\nname = \"a\"\n[[host]]\nname = \"b\"\nuser = \"root\"\n",
            "f",
            &o,
        )
        .unwrap();
        assert_eq!(inv.hosts[0].user.as_deref(), Some("ops"));
        assert_eq!(inv.hosts[1].user.as_deref(), Some("root"));
        let none = parse_inventory("[[host]]\nname = \"a\"\n", "f", &Overrides::default()).unwrap();
        assert_eq!(none.hosts[0].user, None);
    }

    #[test]
    fn example_inventory_parses() {
        let text = include_str!("../hosts.example.toml");
        let inv = parse_inventory(text, "hosts.example.toml", &Overrides::default()).unwrap();
        assert!(inv.hosts.len() >= 3);
        assert!(inv.caps.max_devices_per_user.is_some());
        assert_eq!(
            inv.emails.get("alice").map(String::as_str),
            Some("alice.smith@lab.example.org")
        );
    }

    #[test]
    fn inheritance_and_order() {
        let text = r#"
[defaults]
user = "ops"
sudo = "sudo -n"
[[group]]
name = "a100"
hosts = ["gpu1", "gpu2"]
port = 2222
[[host]]
name = "gpu3"
address = "10.0.0.3"
group = "a100"
user = "root"
sudo = ""
[limits]
max_devices_per_user = 2
max_devices_for_user = { alice = 4 }
"#;
        let inv = parse_inventory(
            text,
            "f.toml",
            &Overrides {
                user: Some("cli".into()),
            },
        )
        .unwrap();
        let ids: Vec<_> = inv.hosts.iter().map(|h| &*h.id.0).collect();
        assert_eq!(ids, ["gpu1", "gpu2", "gpu3"]);
        assert_eq!(inv.hosts[0].user.as_deref(), Some("ops"));
        assert_eq!(inv.hosts[0].port, Some(2222));
        assert_eq!(inv.hosts[2].address, "10.0.0.3");
        assert_eq!(inv.hosts[2].port, Some(2222));
        assert!(inv.hosts[2].sudo.is_empty());
        assert_eq!(inv.caps.max_devices_for_user.get("alice"), Some(&4));
    }

    #[test]
    fn errors_name_file_line_and_key() {
        let o = Overrides::default();
        let error = |text: &str| {
            parse_inventory(text, "inv.toml", &o)
                .unwrap_err()
                .to_string()
        };
        let cases = [
            // serde's own: unknown key, wrong type.
            ("[[host]]\nname = \"a\"\nprot = 22\n", "line 3", "prot"),
            ("[[host]]\nname = \"a\"\nport = \"x\"\n", "line 3", "port"),
            // Ours, at the offending value.
            (
                "[[host]]\nname = \"a\"\n\ngroup = \"nope\"\n",
                "line 4: ",
                "key `group`: unknown group `nope`",
            ),
            (
                "[[host]]\nname = \"a\"\n[[host]]\nname = \"a\"\n",
                "line 4: ",
                "host `a` is listed twice",
            ),
            (
                "[[group]]\nname = \"g\"\nhosts = [\"a\",\n  \"a\"]\n",
                "line 4: ",
                "listed twice",
            ),
            (
                "[[group]]\nname = \"g\"\n[[group]]\nname = \"g\"\n",
                "line 4: ",
                "[[group]] `g` is defined twice",
            ),
            (
                "[[host]]\nname = \"a\"\nssh_options = [\"nope\"]\n",
                "line 3: ",
                "key `ssh_options`: \"nope\" is not Key=Value",
            ),
            (
                "[defaults]\nport = 0\n[[host]]\nname = \"a\"\n",
                "line 2: ",
                "key `port`",
            ),
            (
                "[[host]]\nname = \"a\"\npython = \" \"\n",
                "line 3: ",
                "key `python`: must not be empty",
            ),
            (
                "[[host]]\nname = \"a\"\nnvidia_smi = \"'unclosed\"\n",
                "line 2: ",
                "key `nvidia_smi`: ",
            ),
            (
                "[[host]]\nname = \"a\"\naddress = \"-oProxyCommand=x\"\n",
                "line 2: ",
                "bad address",
            ),
            (
                "[[group]]\nname = \"g\"\nhosts = [\"\"]\n",
                "line 3: ",
                "bad address",
            ),
        ];
        for (text, line, what) in cases {
            let m = error(text);
            assert!(
                m.starts_with("inv.toml: ") && m.contains(line) && m.contains(what),
                "{text:?}: {m}"
            );
        }
        assert!(error("").contains("no hosts"));
    }

    #[test]
    fn rules_have_their_own_grace_or_only_warn() {
        let text = "[[host]]\nname = \"gpu1\"\n\n[policy.non-env-processes]\naction = \"warn\"\n\n[policy.env-memory]\ngrace = \"15m\"\n";
        let inv = parse_inventory(text, "hosts.toml", &Overrides::default()).unwrap();
        assert_eq!(
            inv.policy.into_iter().collect::<Vec<_>>(),
            [
                (
                    Rule::NonEnvProcesses,
                    RuleGrace {
                        warn_only: true,
                        after: None
                    }
                ),
                (
                    Rule::EnvMemory,
                    RuleGrace {
                        warn_only: false,
                        after: Some(std::time::Duration::from_secs(900))
                    }
                ),
            ]
        );
        for (bad, says) in [
            ("[policy.gpu-hogs]\naction = \"warn\"", "unknown rule"),
            (
                "[policy.env-devices]\naction = \"kill\"",
                "line 5: [policy.env-devices]: key `action`: `kill` is neither",
            ),
            (
                "[policy.env-devices]\ngrace = \"soon\"",
                "line 5: [policy.env-devices]: key `grace`",
            ),
            (
                "[policy.env-devices]\nwhen = \"now\"",
                "unknown field `when`",
            ),
        ] {
            let text = format!("[[host]]\nname = \"gpu1\"\n\n{bad}\n");
            let e = parse_inventory(&text, "hosts.toml", &Overrides::default()).unwrap_err();
            assert!(e.message.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn exemptions_name_a_user_or_a_host_and_maybe_a_window() {
        let text = "[[host]]\nname = \"gpu1\"\n\n[[exempt]]\nuser = \"alice\"\nhost = \"gpu1\"\nfrom = \"2026-11-23T08:00:00Z\"\nuntil = \"2026-11-23T20:00:00Z\"\nreason = \"a deadline\"\n\n[[exempt]]\nuser = \"bob\"\n";
        let inv = parse_inventory(text, "hosts.toml", &Overrides::default()).unwrap();
        assert_eq!(inv.exempt.len(), 2);
        let e = &inv.exempt[0];
        assert_eq!(
            (
                e.user.as_deref(),
                e.host.as_ref().map(|h| &*h.0),
                e.reason.as_str()
            ),
            (Some("alice"), Some("gpu1"), "a deadline")
        );
        assert_eq!(e.until_ms.unwrap() - e.from_ms.unwrap(), 12 * 3600 * 1000);
        assert_eq!(
            (inv.exempt[1].from_ms, inv.exempt[1].host.as_ref()),
            (None, None)
        );
        let text = "[[host]]\nname = \"gpu1\"\n\n[[exempt]]\ngroup = \"lab gpu@ad.example.edu\"\n";
        let inv = parse_inventory(text, "hosts.toml", &Overrides::default()).unwrap();
        assert_eq!(
            inv.exempt[0].group.as_deref(),
            Some("lab gpu@ad.example.edu")
        );
        assert_eq!(inv.exempt[0].user, None);
        for (bad, says) in [
            ("group = \"lab\\u001bgpu\"", "key `group`: not a group name"),
            ("group = \"\"", "key `group`: not a group name"),
            ("reason = \"x\"", "name a `user`, a `group` or a `host`"),
            (
                "user = \"a\"\nfrom = \"tomorrow\"",
                "key `from`: not a time",
            ),
            ("host = \"gpu9\"", "`gpu9` is no host of this inventory"),
            (
                "user = \"a\"\nfrom = \"2026-11-23T08:00:00Z\"\nuntil = \"2026-11-23T07:00:00Z\"",
                "not after `from`",
            ),
            (
                "user = \"a\"\nprocess = \"train.py\"",
                "unknown field `process`",
            ),
        ] {
            let text = format!("[[host]]\nname = \"gpu1\"\n\n[[exempt]]\n{bad}\n");
            let e = parse_inventory(&text, "hosts.toml", &Overrides::default()).unwrap_err();
            assert!(e.message.contains(says), "{bad}: {e}");
        }
    }
}
