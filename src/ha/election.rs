//! The election on etcd: this box's lease, kept alive by a task of its
//! own, and each cycle's look at the election key.
//!
//! Each box holds a lease of `--ha-ttl`, kept alive every third of it.
//! Before each cycle it tries to create the key under that lease (one
//! transaction: create if absent, else read it); whoever's lease holds the
//! key leads. A leader that dies or is paused stops keeping its lease
//! alive: etcd deletes the key with it when the lease ends, and the next
//! box to look creates it again, with a higher create revision: the new
//! epoch. A box acts only while its own clock says the lease has at least
//! a keep-alive tick left, so a leader cut off from etcd stops acting
//! before etcd lets another take over.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use tokio::time::Instant;

use serde::{Deserialize, Serialize};

use super::{standing, HaSpec, KeySeen, Standing};
use crate::rules::shards::Published;

/// This box's lease, as the keep-alive task last saw it.
#[derive(Debug, Default)]
struct Lease {
    id: Option<i64>,
    /// Until when etcd keeps it (our clock, from when the last keep-alive
    /// that etcd answered was sent).
    until: Option<Instant>,
    /// What went wrong last, if the lease is not live.
    trouble: Option<Trouble>,
    /// Bumped when this box steps down: a renewal begun before is void.
    generation: u64,
}

/// A box's part in the election.
pub struct Elector {
    spec: Arc<HaSpec>,
    client: Client,
    lease: Arc<Mutex<Lease>>,
    keeper: tokio::task::JoinHandle<()>,
    /// The digest of the configuration this box runs now (a reload
    /// changes it).
    config: Mutex<String>,
}

impl std::fmt::Debug for Elector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Elector").field("spec", &self.spec).finish()
    }
}

/// Why etcd could not be reached or used.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("cannot read {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("etcd at {endpoints}")]
    Client {
        endpoints: String,
        #[source]
        source: etcd_client::Error,
    },
}

/// A request etcd refused or did not answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Asked {
    #[error("etcd did not answer")]
    NoAnswer,
    #[error(transparent)]
    Refused(Arc<etcd_client::Error>),
}

impl Asked {
    /// A request's result, within its timeout.
    fn of<T>(
        result: Result<Result<T, etcd_client::Error>, tokio::time::error::Elapsed>,
    ) -> Result<T, Asked> {
        match result {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(e)) => Err(Asked::Refused(Arc::new(e))),
            Err(_) => Err(Asked::NoAnswer),
        }
    }
}

/// What went wrong with this box's lease last.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Trouble {
    #[error("cannot get a lease")]
    Grant(#[source] Asked),
    #[error("cannot keep the lease alive")]
    KeepAlive(#[source] Asked),
    #[error("the keep-alive stream ended")]
    StreamEnded,
    #[error("the lease ended")]
    Ended,
    #[error("stepped down")]
    SteppedDown,
}

/// Why this box has no live lease now.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LeaseError {
    #[error("no live etcd lease yet")]
    NotYet,
    #[error("no live etcd lease")]
    Lost(#[source] Trouble),
}

/// Why this shard's part was not published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("it cannot be encoded")]
    Encode(#[source] serde_json::Error),
    #[error("{bytes} bytes, over the {most} bytes a part may hold: not published, and the last one taken back")]
    TooLarge { bytes: usize, most: usize },
    #[error(transparent)]
    Put(Asked),
}

/// A client for `spec`'s etcd: TLS and auth as asked; nothing is sent
/// until a request is (etcd may be down when we start).
///
/// # Errors
/// A certificate cannot be read, or the endpoints or auth are refused.
pub async fn connect(spec: &HaSpec) -> Result<Client, EtcdError> {
    let timeout = spec.request_timeout();
    let mut options = ConnectOptions::new()
        .with_connect_timeout(timeout)
        .with_timeout(timeout)
        .with_keep_alive(spec.tick().max(Duration::from_secs(1)), timeout);
    if let Some((user, password)) = &spec.user {
        options = options.with_user(user.clone(), password.0.clone());
    }
    if let Some(tls) = &spec.tls {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|source| EtcdError::Read {
                path: p.display().to_string(),
                source,
            })
        };
        let mut t = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(read(&tls.ca)?));
        if let Some((cert, key)) = &tls.identity {
            t = t.identity(etcd_client::Identity::from_pem(read(cert)?, read(key)?));
        }
        options = options.with_tls(t);
    }
    Client::connect(&spec.endpoints, Some(options))
        .await
        .map_err(|source| EtcdError::Client {
            endpoints: spec.endpoints.join(","),
            source,
        })
}

impl Elector {
    /// Joins the election: a client, and the task that keeps this box's
    /// lease alive (granting a new one when it is lost).
    ///
    /// # Errors
    /// As [`connect`].
    pub async fn start(spec: HaSpec, fencing: super::Fencing) -> Result<Elector, EtcdError> {
        let mut client = connect(&spec).await?;
        let spec = Arc::new(spec);
        let lease = Arc::new(Mutex::new(Lease::default()));
        // The first lease before the first cycle (etcd may be down: the
        // task keeps trying).
        let mut stream = None;
        renew(&spec, &mut client, &lease, &mut stream, &fencing).await;
        let keeper = tokio::spawn(keep(
            Arc::clone(&spec),
            client.clone(),
            Arc::clone(&lease),
            stream,
            fencing,
        ));
        Ok(Elector {
            config: Mutex::new(spec.config.clone()),
            spec,
            client,
            lease,
            keeper,
        })
    }

    /// The digest of the configuration this box runs from now on (after a
    /// reload), published from the next look.
    pub fn set_config(&self, digest: String) {
        *self.config.lock().unwrap_or_else(|e| e.into_inner()) = digest;
    }

    /// What this box was started with.
    pub fn spec(&self) -> &HaSpec {
        &self.spec
    }

    /// The digest of the configuration this box runs.
    pub fn config(&self) -> String {
        self.config
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Where this box stands for the next cycle and, sharded, the other
    /// shards' parts as published (one read, at one etcd revision).
    pub async fn look(&self) -> Look {
        let (id, until) = match self.live_lease() {
            Ok(l) => l,
            Err(why) => {
                return Look {
                    standing: standing(
                        Err(crate::error::chain(&why)),
                        KeySeen::Unanswered(String::new()),
                    ),
                    others: Vec::new(),
                    until: None,
                    configs: Vec::new(),
                }
            }
        };
        let key = self.spec.election_key();
        let put = TxnOp::put(
            key.as_bytes(),
            self.spec.name.as_bytes(),
            Some(PutOptions::new().with_lease(id)),
        );
        // This box's configuration under its lease, and every box's, in
        // the same round trip.
        let prefix = self.spec.configs_prefix();
        let config = TxnOp::put(
            format!("{prefix}{}", self.spec.name),
            self.config(),
            Some(PutOptions::new().with_lease(id)),
        );
        let configs = || TxnOp::get(prefix.as_bytes(), Some(GetOptions::new().with_prefix()));
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.as_bytes(),
                CompareOp::Equal,
                0,
            )])
            .and_then([put, config.clone(), configs()])
            .or_else([TxnOp::get(key.as_bytes(), None), config, configs()]);
        let mut client = self.client.clone();
        let timeout = self.spec.request_timeout();
        let mut configs = Vec::new();
        let seen = match tokio::time::timeout(timeout, client.txn(txn)).await {
            Err(_) => KeySeen::Unanswered(format!(
                "no answer within {}",
                humantime::format_duration(timeout)
            )),
            Ok(Err(e)) => KeySeen::Unanswered(e.to_string()),
            Ok(Ok(resp)) => {
                configs = configs_seen(&resp, &prefix);
                key_seen(&resp, key.as_bytes())
            }
        };
        let standing = standing(Ok(id), seen);
        // Only a shard's leader acts on the others' parts.
        let others = match (standing.leads(), self.spec.counts_prefix()) {
            (true, Some(prefix)) => self.others(&prefix).await,
            _ => Vec::new(),
        };
        Look {
            standing,
            others,
            until: Some(until.into_std()),
            configs,
        }
    }

    /// The other shards' parts, read at one revision; none (said on
    /// stderr) when they cannot be read: their hosts count as unseen.
    async fn others(&self, prefix: &str) -> Vec<Published> {
        let mut client = self.client.clone();
        let get = client.get(prefix, Some(etcd_client::GetOptions::new().with_prefix()));
        let own = self.spec.counts_key().unwrap_or_default();
        match tokio::time::timeout(self.spec.request_timeout(), get).await {
            Ok(Ok(resp)) => {
                let parts = resp
                    .kvs()
                    .iter()
                    .filter(|kv| {
                        kv.key().starts_with(prefix.as_bytes()) && kv.key() != own.as_bytes()
                    })
                    .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.value()));
                read_parts(parts)
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the other shards' parts cannot be read: their hosts are not counted");
                Vec::new()
            }
            Err(_) => {
                tracing::warn!(
                    "the other shards' parts: etcd did not answer; their hosts are not counted"
                );
                Vec::new()
            }
        }
    }

    /// Publishes this shard's part under this box's lease (it lapses with
    /// the lease: a dead shard drops out of everyone's counts). A part over
    /// [`MAX_PART`] / shards is published reduced ([`Published::reduced`]:
    /// what only records say left out); one still too large is not, and
    /// the last one stays while the lease lives: the others never count
    /// fewer of this shard's devices for what a user wrote.
    ///
    /// # Errors
    /// etcd did not take it, it is too large even reduced, or this box has
    /// no live lease.
    pub async fn publish(&self, parts: Vec<Published>) -> Result<(), PublishError> {
        let (Some(key), Some(shard)) = (self.spec.counts_key(), self.spec.shard) else {
            return Ok(());
        };
        let (id, _) = self.live_lease()?;
        let encode = |hosts: Vec<Published>| {
            serde_json::to_vec(&Part {
                shard: shard.k,
                of: shard.n,
                hosts,
            })
            .map_err(PublishError::Encode)
        };
        let compact: Vec<Published> = parts.into_iter().map(Published::compact).collect();
        let most = MAX_PART / shard.n as usize;
        let mut value = encode(compact.clone())?;
        if value.len() > most {
            let whole = value.len();
            value = encode(compact.into_iter().map(Published::reduced).collect())?;
            if value.len() > most {
                return Err(PublishError::TooLarge {
                    bytes: value.len(),
                    most,
                });
            }
            tracing::warn!(
                bytes = whole,
                most,
                "this shard's part is too large: published without the idle devices only records vouch for"
            );
        }
        let mut client = self.client.clone();
        let timeout = self.spec.request_timeout();
        let put = client.put(
            key.as_bytes(),
            value,
            Some(PutOptions::new().with_lease(id)),
        );
        let failed = match Asked::of(tokio::time::timeout(timeout, put).await) {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let _ = tokio::time::timeout(timeout, client.delete(key.as_bytes(), None)).await;
        Err(PublishError::Put(failed))
    }

    /// The lease and until when it holds, if live for at least one more
    /// keep-alive tick.
    fn live_lease(&self) -> Result<(i64, Instant), LeaseError> {
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        let margin = self.spec.tick();
        match (lease.id, lease.until) {
            (Some(id), Some(until)) if until > Instant::now() + margin => Ok((id, until)),
            _ => Err(match &lease.trouble {
                Some(t) => LeaseError::Lost(t.clone()),
                None => LeaseError::NotYet,
            }),
        }
    }

    /// Gives up leading: the lease is revoked (etcd deletes the key with
    /// it, if it is still ours) and a new one will be granted.
    pub async fn step_down(&self) {
        let id = {
            let mut lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
            lease.until = None;
            lease.trouble = Some(Trouble::SteppedDown);
            lease.generation += 1;
            lease.id.take()
        };
        if let Some(id) = id {
            let mut client = self.client.clone();
            let _ =
                tokio::time::timeout(self.spec.request_timeout(), client.lease_revoke(id)).await;
        }
    }

    /// Leaves the election (the run ends): the lease is revoked, so another
    /// box can lead at once.
    pub async fn leave(self) {
        self.keeper.abort();
        self.step_down().await;
    }
}

impl Drop for Elector {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// Whether `e` says the lease is gone (it ended, or was revoked).
fn lease_gone(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::LeaseKeepAliveError(_) => true,
        // gRPC's NOT_FOUND (5): etcd's "requested lease not found".
        etcd_client::Error::GRpcStatus(s) => i32::from(s.code()) == 5,
        _ => false,
    }
}

/// What one look at etcd found (see [`Elector::look`]).
#[derive(Debug, Clone)]
pub struct Look {
    pub standing: Standing,
    /// The other shards' hosts, as they last published them.
    pub others: Vec<Published>,
    /// Until when this box's lease holds (our clock), if it has one.
    pub until: Option<std::time::Instant>,
    /// Each live box's configuration digest (name, digest), this one's
    /// included.
    pub configs: Vec<(String, String)>,
}

/// A shard's published part: the value of its key.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Part {
    shard: u32,
    of: u32,
    hosts: Vec<Published>,
}

/// The most all shards' parts may hold together (etcd answers a read in
/// at most 4 MiB): each part gets its share.
pub const MAX_PART: usize = 3 << 20;

/// The hosts of the parts `(key, value)` (a part that does not parse is
/// left out, said on stderr: its hosts count as unseen).
fn read_parts<'a>(parts: impl Iterator<Item = (String, &'a [u8])>) -> Vec<Published> {
    let mut hosts = Vec::new();
    for (key, value) in parts {
        match serde_json::from_slice::<Part>(value) {
            Ok(part) => hosts.extend(part.hosts),
            Err(e) => tracing::warn!(
                %key,
                error = %e,
                "a shard's part does not parse: its hosts are not counted"
            ),
        }
    }
    hosts
}

/// What the election transaction says of the key.
fn key_seen(resp: &etcd_client::TxnResponse, key: &[u8]) -> KeySeen {
    let revision = resp.header().map_or(0, |h| h.revision());
    if resp.succeeded() {
        // An epoch of 0 would fence nothing.
        return match u64::try_from(revision) {
            Ok(r) if r > 0 => KeySeen::Created { revision: r },
            _ => KeySeen::Unanswered("etcd's answer holds no revision".into()),
        };
    }
    for op in resp.op_responses() {
        if let TxnOpResponse::Get(get) = op {
            if let Some(kv) = get.kvs().first().filter(|kv| kv.key() == key) {
                return KeySeen::Held {
                    name: String::from_utf8_lossy(kv.value()).into_owned(),
                    lease: kv.lease(),
                    create_revision: u64::try_from(kv.create_revision()).unwrap_or(0),
                };
            }
        }
    }
    // Deleted between the compare and the read: look again next cycle.
    KeySeen::Unanswered("the key changed while read".into())
}

/// The boxes' configurations (name, digest) a look's answer holds under
/// `prefix`.
fn configs_seen(resp: &etcd_client::TxnResponse, prefix: &str) -> Vec<(String, String)> {
    resp.op_responses()
        .iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.kvs()),
            _ => None,
        })
        .flatten()
        .filter_map(|kv| {
            let name = kv.key().strip_prefix(prefix.as_bytes())?;
            Some((
                String::from_utf8_lossy(name).into_owned(),
                String::from_utf8_lossy(kv.value()).into_owned(),
            ))
        })
        .collect()
}

/// The keep-alive stream of a lease, kept across ticks.
type Stream = (
    i64,
    etcd_client::LeaseKeeper,
    etcd_client::LeaseKeepAliveStream,
);

/// Keeps this box's lease alive every tick (see [`renew`]), and tells
/// `fencing` until when it holds.
async fn keep(
    spec: Arc<HaSpec>,
    mut client: Client,
    lease: Arc<Mutex<Lease>>,
    mut stream: Option<Stream>,
    fencing: super::Fencing,
) {
    loop {
        tokio::time::sleep(spec.tick()).await;
        renew(&spec, &mut client, &lease, &mut stream, &fencing).await;
    }
}

/// One keep-alive of this box's lease, or a new lease when there is none
/// or etcd says it ended. A keep-alive etcd does not answer leaves the
/// lease to lapse on our clock.
async fn renew(
    spec: &HaSpec,
    client: &mut Client,
    lease: &Mutex<Lease>,
    stream: &mut Option<Stream>,
    fencing: &super::Fencing,
) {
    let ttl = i64::try_from(spec.ttl_secs()).unwrap_or(i64::MAX);
    let timeout = spec.request_timeout();
    let (id, generation) = {
        let l = lease.lock().unwrap_or_else(|e| e.into_inner());
        (l.id, l.generation)
    };
    let sent = Instant::now();
    let result: Result<(i64, i64), Trouble> = match id {
        None => Asked::of(tokio::time::timeout(timeout, client.lease_grant(ttl, None)).await)
            .map(|g| (g.id(), g.ttl()))
            .map_err(Trouble::Grant),
        Some(id) => {
            let once = async {
                if stream.as_ref().map(|s| s.0) != Some(id) {
                    let (k, s) = client.lease_keep_alive(id).await?;
                    *stream = Some((id, k, s));
                }
                match stream.as_mut() {
                    Some((_, keeper, answers)) => {
                        keeper.keep_alive().await?;
                        answers.message().await
                    }
                    None => Ok(None),
                }
            };
            match tokio::time::timeout(timeout, once).await {
                Ok(Ok(Some(r))) => Ok((id, r.ttl())),
                Ok(Ok(None)) => Err(Trouble::StreamEnded),
                // etcd no longer has it: as a TTL of 0, a new one.
                Ok(Err(e)) if lease_gone(&e) => Ok((id, 0)),
                Ok(Err(e)) => Err(Trouble::KeepAlive(Asked::Refused(Arc::new(e)))),
                Err(_) => Err(Trouble::KeepAlive(Asked::NoAnswer)),
            }
        }
    };
    tracing::debug!(?result, "etcd lease: kept alive (id, seconds left) or not");
    if result.is_err() {
        *stream = None;
    }
    let mut l = lease.lock().unwrap_or_else(|e| e.into_inner());
    if l.generation != generation {
        // Stepped down meanwhile: what this renewal found is not ours.
        *stream = None;
        return;
    }
    match result {
        Ok((id, left)) if left > 0 => {
            l.id = Some(id);
            l.until = Some(sent + Duration::from_secs(left.unsigned_abs()));
            l.trouble = None;
        }
        Ok(_) => {
            // etcd says it ended (we were paused, or cut off too long): a
            // new one next tick.
            *stream = None;
            *l = Lease {
                trouble: Some(Trouble::Ended),
                generation,
                ..Lease::default()
            };
        }
        Err(why) => l.trouble = Some(why),
    }
    // What a cycle under way may still do (see `Fencing::may_act`).
    fencing.lease_until(l.until.map(Instant::into_std));
}
