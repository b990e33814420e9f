//! High availability on etcd: several enforcer boxes, one of which acts.
//!
//! - [`election`]: every box runs the cycle; the one whose etcd lease holds
//!   the election key is the leader and acts, the others report as a dry
//!   run and take over when that lease ends. The leader's **epoch** is the
//!   key's create revision: it only grows, one per new leader.
//! - [`fence`]: the epoch rides on every request to the hosts' agents,
//!   which keep the highest they have seen (in a root-only file under
//!   `/run`) and refuse anything older, so a leader that was paused past
//!   its lease cannot act after another has.
//!
//! What is decided from what etcd said is pure ([`standing`]); the client
//! and its keep-alive task are the thin shell around it.

pub mod doctor;
pub mod election;
pub use crate::host::fence;

use std::path::PathBuf;
use std::time::Duration;

pub use election::Elector;
pub use fence::{Fencing, Refusal, FENCE_DIR};

/// Where the election (and the shards' counts) live in etcd unless
/// `--ha-key` says.
pub const DEFAULT_KEY: &str = "/genv-enforce";

/// What `--ha-*` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaSpec {
    /// etcd's client URLs (`http://10.0.0.1:2379`, ...).
    pub endpoints: Vec<String>,
    /// The prefix of our keys (`--ha-key`).
    pub key: String,
    /// This box's name, as the key's value says it (`--ha-name`).
    pub name: String,
    /// The lease's time to live (`--ha-ttl`; about three intervals).
    pub ttl: Duration,
    /// Where the hosts' agents keep the highest epoch they have seen.
    pub fence_dir: String,
    /// TLS: the CA that signs etcd's certificates, and ours if etcd asks
    /// for one.
    pub tls: Option<TlsSpec>,
    /// etcd's user and password (`--ha-user`, `--ha-password-file`).
    pub user: Option<(String, Secret)>,
    /// `--shard K/N`: this box enforces shard K of N.
    pub shard: Option<Shard>,
    /// The digest of the configuration this box runs, published beside the
    /// election for the other boxes and `doctor` to compare (empty: none).
    pub config: String,
}

/// A secret (a password): its `Debug` says nothing of it, so no log, panic
/// or `{:?}` of a spec ever shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// One shard of the fleet: the hosts at places `k - 1`, `k - 1 + n`, ...
/// of the whole inventory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub k: u32,
    pub n: u32,
}

impl Shard {
    /// Whether the host at `position` (from 0) of the inventory is ours.
    pub fn holds(self, position: usize) -> bool {
        position % self.n as usize == (self.k - 1) as usize
    }
}

impl std::str::FromStr for Shard {
    type Err = String;

    /// `K/N`, 1 <= K <= N <= 1024.
    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || format!("{text:?}: a shard is K/N, from 1/N to N/N (N at most 1024)");
        let (k, n) = text.split_once('/').ok_or_else(bad)?;
        let (k, n): (u32, u32) = (k.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?);
        if k == 0 || k > n || n > 1024 {
            return Err(bad());
        }
        Ok(Shard { k, n })
    }
}

/// TLS to etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSpec {
    pub ca: PathBuf,
    /// Our certificate and key, for etcd's `--client-cert-auth`.
    pub identity: Option<(PathBuf, PathBuf)>,
}

impl HaSpec {
    /// The election key: one per shard.
    pub fn election_key(&self) -> String {
        match self.shard {
            Some(s) => format!("{}/shard-{}-of-{}/leader", self.key, s.k, s.n),
            None => format!("{}/leader", self.key),
        }
    }

    /// Where the shards of this sharding publish their parts.
    pub fn counts_prefix(&self) -> Option<String> {
        self.shard
            .map(|s| format!("{}/counts-of-{}/", self.key, s.n))
    }

    /// Where this shard publishes its part.
    pub fn counts_key(&self) -> Option<String> {
        Some(format!("{}{}", self.counts_prefix()?, self.shard?.k))
    }

    /// Where each box publishes its configuration's digest (all shards of
    /// one `--ha-key` alike), by box name.
    pub fn configs_prefix(&self) -> String {
        format!("{}/config/", self.key)
    }

    /// The lease's time to live in whole seconds (etcd's unit), rounded
    /// up.
    pub fn ttl_secs(&self) -> u64 {
        self.ttl.as_secs() + u64::from(self.ttl.subsec_nanos() > 0)
    }

    /// How often the lease is kept alive: a third of its time to live.
    pub fn tick(&self) -> Duration {
        Duration::from_secs(self.ttl_secs()) / 3
    }

    /// How long one request to etcd may take.
    pub fn request_timeout(&self) -> Duration {
        self.tick()
            .clamp(Duration::from_millis(200), Duration::from_secs(5))
    }
}

/// The boxes of `configs` (name, digest) whose configuration is not
/// `own`'s, `name` aside.
pub fn differing<'a>(
    name: &str,
    own: &str,
    configs: &'a [(String, String)],
) -> Vec<&'a (String, String)> {
    configs
        .iter()
        .filter(|(n, digest)| n != name && digest != own)
        .collect()
}

/// The lease's default time to live for `interval`: three intervals, from
/// 3 s (etcd's floor is about 1.5 s) to an hour (`--ha-ttl`'s most), 30 s
/// for a run of one cycle.
pub fn default_ttl(interval: Duration) -> Duration {
    if interval.is_zero() {
        Duration::from_secs(30)
    } else {
        interval
            .saturating_mul(3)
            .clamp(Duration::from_secs(3), Duration::from_secs(3600))
    }
}

/// Where this box stands for one cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// It holds the key under a live lease: it acts, with this epoch.
    Leader { epoch: u64 },
    /// Another box leads (`epoch` is theirs): this one reports only.
    Follower { leader: String, epoch: u64 },
    /// No leader can be told (etcd unreachable, no lease of ours): this
    /// one reports only, and says why.
    Unsure { why: String },
}

impl Standing {
    /// Whether this box acts this cycle.
    pub fn leads(&self) -> bool {
        matches!(self, Standing::Leader { .. })
    }

    /// The epoch of the leader this box knows of, if any.
    pub fn epoch(&self) -> Option<u64> {
        match self {
            Standing::Leader { epoch } | Standing::Follower { epoch, .. } => Some(*epoch),
            Standing::Unsure { .. } => None,
        }
    }

    /// One line for the log when the standing changes.
    pub fn describe(&self) -> String {
        match self {
            Standing::Leader { epoch } => format!("leader (epoch {epoch}): acting"),
            Standing::Follower { leader, epoch } => {
                format!("following {leader} (epoch {epoch}): reporting only, as a dry run")
            }
            Standing::Unsure { why } => format!("not acting: {why}"),
        }
    }

    /// Whether going from `self` to `next` is worth a line (a new role,
    /// leader or epoch; the same trouble twice is said once).
    pub fn changed(&self, next: &Standing) -> bool {
        match (self, next) {
            (Standing::Unsure { .. }, Standing::Unsure { .. }) => false,
            _ => self != next,
        }
    }
}

/// What etcd said of the election key this cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySeen {
    /// Our transaction created it under our lease at this revision.
    Created { revision: u64 },
    /// It exists: who holds it, under which lease, since which revision.
    Held {
        name: String,
        lease: i64,
        create_revision: u64,
    },
    /// etcd did not answer, or refused.
    Unanswered(String),
}

/// Where this box stands, from its lease (`None` with why: none, or too
/// near its end to act) and what etcd said of the key. Pure.
pub fn standing(lease: Result<i64, String>, key: KeySeen) -> Standing {
    let ours = match lease {
        Ok(id) => id,
        Err(why) => return Standing::Unsure { why },
    };
    match key {
        KeySeen::Created { revision } => Standing::Leader { epoch: revision },
        KeySeen::Held {
            lease,
            create_revision,
            ..
        } if lease == ours => Standing::Leader {
            epoch: create_revision,
        },
        KeySeen::Held {
            name,
            create_revision,
            ..
        } => Standing::Follower {
            leader: name,
            epoch: create_revision,
        },
        KeySeen::Unanswered(why) => Standing::Unsure {
            why: format!("etcd did not answer: {why}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(name: &str, lease: i64, rev: u64) -> KeySeen {
        KeySeen::Held {
            name: name.into(),
            lease,
            create_revision: rev,
        }
    }

    #[test]
    fn a_box_leads_only_under_its_own_live_lease_with_the_keys_create_revision() {
        assert_eq!(
            standing(Ok(7), KeySeen::Created { revision: 40 }),
            Standing::Leader { epoch: 40 }
        );
        assert_eq!(
            standing(Ok(7), held("b", 7, 40)),
            Standing::Leader { epoch: 40 }
        );
        assert_eq!(
            standing(Ok(7), held("b", 8, 41)),
            Standing::Follower {
                leader: "b".into(),
                epoch: 41
            }
        );
        // Without a lease nothing etcd says makes it a leader.
        for key in [KeySeen::Created { revision: 40 }, held("a", 7, 40)] {
            assert_eq!(
                standing(Err("no lease".into()), key),
                Standing::Unsure {
                    why: "no lease".into()
                }
            );
        }
        let unsure = standing(Ok(7), KeySeen::Unanswered("timed out".into()));
        assert_eq!(
            unsure,
            Standing::Unsure {
                why: "etcd did not answer: timed out".into()
            }
        );
        assert!(!unsure.leads() && unsure.epoch().is_none());
    }

    #[test]
    fn a_shard_holds_every_nth_host_of_the_inventory() {
        let s: Shard = "2/3".parse().unwrap();
        let held: Vec<usize> = (0..9).filter(|&p| s.holds(p)).collect();
        assert_eq!(held, [1, 4, 7]);
        assert_eq!("1024/1024".parse::<Shard>(), Ok(Shard { k: 1024, n: 1024 }));
        let one: Shard = "1/1".parse().unwrap();
        assert!((0..5).all(|p| one.holds(p)));
        for bad in ["0/2", "3/2", "1/0", "2", "a/b", "1/2000", "-1/2"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
    }

    #[test]
    fn changes_are_said_once() {
        let leader = Standing::Leader { epoch: 3 };
        let unsure = |w: &str| Standing::Unsure { why: w.into() };
        assert!(!leader.changed(&leader.clone()));
        assert!(leader.changed(&Standing::Leader { epoch: 4 }));
        assert!(leader.changed(&unsure("x")));
        assert!(!unsure("x").changed(&unsure("y")));
        assert!(unsure("x").changed(&leader));
        assert!(leader.describe().contains("epoch 3"));
        assert!(Standing::Follower {
            leader: "box-b".into(),
            epoch: 9
        }
        .describe()
        .contains("following box-b (epoch 9)"));
    }

    #[test]
    fn the_lease_lives_three_intervals_and_is_kept_alive_three_times_in_one() {
        assert_eq!(
            default_ttl(Duration::from_secs(10)),
            Duration::from_secs(30)
        );
        assert_eq!(
            default_ttl(Duration::from_millis(500)),
            Duration::from_secs(3)
        );
        assert_eq!(default_ttl(Duration::ZERO), Duration::from_secs(30));
        assert_eq!(
            default_ttl(Duration::from_secs(7200)),
            Duration::from_secs(3600)
        );
        let spec = HaSpec {
            endpoints: vec![],
            key: DEFAULT_KEY.into(),
            name: "a".into(),
            ttl: Duration::from_secs(3),
            fence_dir: FENCE_DIR.into(),
            tls: None,
            user: None,
            shard: None,
            config: "c1".into(),
        };
        assert_eq!(spec.tick(), Duration::from_secs(1));
        assert_eq!(spec.configs_prefix(), "/genv-enforce/config/");
        let configs = [
            ("a".to_string(), "c1".to_string()),
            ("b".to_string(), "c1".to_string()),
            ("c".to_string(), "c2".to_string()),
        ];
        assert_eq!(differing("a", "c1", &configs), [&configs[2]]);
        assert_eq!(differing("c", "c2", &configs), [&configs[0], &configs[1]]);
        let odd = HaSpec {
            ttl: Duration::from_millis(2900),
            ..spec.clone()
        };
        assert_eq!((odd.ttl_secs(), odd.tick()), (3, Duration::from_secs(1)));
        assert_eq!(spec.election_key(), "/genv-enforce/leader");
        assert_eq!(spec.counts_key(), None);
        let sharded = HaSpec {
            shard: Some("2/3".parse().unwrap()),
            ..spec.clone()
        };
        assert_eq!(sharded.election_key(), "/genv-enforce/shard-2-of-3/leader");
        assert_eq!(
            sharded.counts_prefix().unwrap(),
            "/genv-enforce/counts-of-3/"
        );
        assert_eq!(sharded.counts_key().unwrap(), "/genv-enforce/counts-of-3/2");
        assert_eq!(spec.request_timeout(), Duration::from_secs(1));
    }
}
