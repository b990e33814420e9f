//! The metrics endpoint's TLS and basic authentication, from a web
//! configuration file in the format Prometheus exporters read
//! (`--web.config.file`, the exporter-toolkit's YAML): the endpoint shows
//! every user's GPU usage, so an admin may want it neither readable by any
//! local user nor sent in the clear.
//!
//! ```yaml
//! tls_server_config:
//!   cert_file: metrics.crt           # relative to this file
//!   key_file: metrics.key            # ours, readable by no one else
//!   client_auth_type: RequireAndVerifyClientCert   # optional
//!   client_ca_file: clients-ca.crt                 # with it
//! basic_auth_users:
//!   prometheus: $2y$10$...           # a bcrypt hash (htpasswd -nBC 10 "")
//! ```
//!
//! Checked whole before anything runs: unknown keys, missing files, a key
//! file others may read, a hash that is not bcrypt are each an error
//! naming the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use thiserror::Error;

/// A web configuration that cannot be used.
#[derive(Debug, Error)]
pub enum WebConfigError {
    #[error("--web.config.file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--web.config.file {}", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: yaml_serde::Error,
    },
    #[error("--web.config.file {}: {what}", path.display())]
    Invalid { path: PathBuf, what: String },
    /// The TLS key file is refused (another user's, or open to others).
    #[error("--web.config.file {}: key_file {}", path.display(), key.display())]
    Key {
        path: PathBuf,
        key: PathBuf,
        #[source]
        source: crate::private::Refusal,
    },
    #[error("--web.config.file {}: TLS", path.display())]
    Tls {
        path: PathBuf,
        #[source]
        source: tokio_rustls::rustls::Error,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    tls_server_config: Option<TlsFile>,
    #[serde(default)]
    basic_auth_users: BTreeMap<String, String>,
    /// Headers and HTTP/2 (exporter-toolkit's): not supported, refused if set.
    http_server_config: Option<yaml_serde::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsFile {
    cert_file: PathBuf,
    key_file: PathBuf,
    #[serde(default)]
    client_auth_type: ClientAuth,
    client_ca_file: Option<PathBuf>,
    min_version: Option<String>,
}

/// exporter-toolkit's client authentication types, those that verify.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
enum ClientAuth {
    #[default]
    NoClientCert,
    VerifyClientCertIfGiven,
    RequireAndVerifyClientCert,
}

/// What the metrics endpoint asks of a client.
#[derive(Clone)]
pub struct WebConfig {
    /// TLS, when set.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// User name -> bcrypt hash; none: no authentication.
    pub users: BTreeMap<String, String>,
    /// bcrypt checks under way at most (each takes tens of ms of CPU on
    /// purpose: unbounded, anyone who can connect would stall us).
    checks: Arc<tokio::sync::Semaphore>,
    /// `Authorization` headers that passed lately (a scraper sends the same
    /// one every time): let in without bcrypt.
    verified: Arc<std::sync::Mutex<std::collections::VecDeque<Vec<u8>>>>,
}

/// Concurrent bcrypt checks, at most.
const CHECKS: usize = 2;
/// Headers that passed, remembered.
const VERIFIED: usize = 8;

/// What a request's credentials get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    In,
    Out,
    /// Every check is busy: try again.
    Busy,
}

impl std::fmt::Debug for WebConfig {
    /// Names the users, never their hashes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebConfig")
            .field("tls", &self.tls.is_some())
            .field("users", &self.users.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl WebConfig {
    /// Reads and checks the file at `path` (its relative paths resolved
    /// beside it).
    ///
    /// # Errors
    /// The file, or one it names, cannot be read, parsed or used.
    pub fn load(path: &Path) -> Result<WebConfig, WebConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| WebConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let file: File = yaml_serde::from_str(&text).map_err(|source| WebConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |what: String| WebConfigError::Invalid {
            path: path.to_path_buf(),
            what,
        };
        if file.http_server_config.is_some() {
            return Err(invalid(
                "http_server_config is not supported (headers, HTTP/2)".into(),
            ));
        }
        for (user, hash) in &file.basic_auth_users {
            if hash.parse::<bcrypt::HashParts>().is_err() {
                return Err(invalid(format!(
                    "basic_auth_users.{user}: not a bcrypt hash (htpasswd -nBC 10 {user})"
                )));
            }
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        let tls = match file.tls_server_config {
            Some(t) => Some(acceptor(&t, dir).map_err(|e| match e {
                Why::Said(what) => invalid(what),
                Why::Key(key, source) => WebConfigError::Key {
                    path: path.to_path_buf(),
                    key,
                    source,
                },
                Why::Tls(source) => WebConfigError::Tls {
                    path: path.to_path_buf(),
                    source,
                },
            })?),
            None => None,
        };
        Ok(WebConfig::new(tls, file.basic_auth_users))
    }

    /// A configuration of these parts.
    pub fn new(tls: Option<tokio_rustls::TlsAcceptor>, users: BTreeMap<String, String>) -> Self {
        WebConfig {
            tls,
            users,
            checks: Arc::new(tokio::sync::Semaphore::new(CHECKS)),
            verified: Arc::default(),
        }
    }

    /// [`WebConfig::admits`] for a request, off the async workers, with at
    /// most [`CHECKS`] bcrypt checks at once (more: [`Admission::Busy`]),
    /// a header seen to pass lately let in at once.
    pub async fn admission(self: &Arc<Self>, authorization: Option<&[u8]>) -> Admission {
        if self.users.is_empty() {
            return Admission::In;
        }
        let header = authorization.map(<[u8]>::to_vec);
        let remembered = |h: &Option<Vec<u8>>| {
            h.as_ref().is_some_and(|h| {
                self.verified
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains(h)
            })
        };
        if remembered(&header) {
            return Admission::In;
        }
        let Ok(permit) = Arc::clone(&self.checks).try_acquire_owned() else {
            return Admission::Busy;
        };
        let web = Arc::clone(self);
        let passed = tokio::task::spawn_blocking(move || {
            let ok = web.admits(header.as_deref());
            if let (true, Some(h)) = (ok, header) {
                let mut v = web.verified.lock().unwrap_or_else(|e| e.into_inner());
                if v.len() >= VERIFIED {
                    v.pop_front();
                }
                v.push_back(h);
            }
            drop(permit);
            ok
        })
        .await
        .unwrap_or(false);
        if passed {
            Admission::In
        } else {
            Admission::Out
        }
    }

    /// Whether a request's `Authorization` header lets it in: always when
    /// no user is set; else `Basic` credentials of a listed user whose
    /// password the hash matches (bcrypt: slow on purpose, call it off the
    /// async workers).
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        if self.users.is_empty() {
            return true;
        }
        let Some((user, password)) = authorization.and_then(basic_credentials) else {
            return false;
        };
        match self.users.get(&user) {
            Some(hash) => bcrypt::verify(password, hash).unwrap_or(false),
            None => {
                // As long as a real check, so that timing tells no names.
                let _ = bcrypt::verify(&password, DUMMY_HASH);
                false
            }
        }
    }
}

/// A bcrypt hash of nothing anyone sends (cost 10, as htpasswd makes).
const DUMMY_HASH: &str = "$2b$10$C6UzMDM.H6dfI/f/IKxGhuuL6jIyjwDzzT1h3Nfw3fGs3Q9Ga6mzi";

/// The user and password of a `Basic` authorization header.
fn basic_credentials(header: &[u8]) -> Option<(String, String)> {
    use base64::Engine;
    let text = std::str::from_utf8(header).ok()?;
    let (scheme, encoded) = text.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let decoded = String::from_utf8(decoded).ok()?;
    let (user, password) = decoded.split_once(':')?;
    Some((user.to_string(), password.to_string()))
}

enum Why {
    Said(String),
    Key(PathBuf, crate::private::Refusal),
    Tls(tokio_rustls::rustls::Error),
}

impl From<tokio_rustls::rustls::Error> for Why {
    fn from(e: tokio_rustls::rustls::Error) -> Self {
        Why::Tls(e)
    }
}

/// The TLS acceptor `t` describes, its files beside `dir`.
fn acceptor(t: &TlsFile, dir: &Path) -> Result<tokio_rustls::TlsAcceptor, Why> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    use tokio_rustls::rustls;
    let at = |p: &Path| dir.join(p);
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(at(&t.cert_file))
        .and_then(|i| i.collect())
        .map_err(|e| Why::Said(format!("cert_file {}: {e}", at(&t.cert_file).display())))?;
    if certs.is_empty() {
        return Err(Why::Said(format!(
            "cert_file {}: no certificate",
            at(&t.cert_file).display()
        )));
    }
    let key_path = at(&t.key_file);
    crate::private::secret_path(&key_path).map_err(|r| Why::Key(key_path.clone(), r))?;
    let key = PrivateKeyDer::from_pem_file(&key_path)
        .map_err(|e| Why::Said(format!("key_file {}: {e}", key_path.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let versions: &[&rustls::SupportedProtocolVersion] = match t.min_version.as_deref() {
        None | Some("TLS12") => rustls::ALL_VERSIONS,
        Some("TLS13") => &[&rustls::version::TLS13],
        Some(other) => return Err(Why::Said(format!("min_version {other}: TLS12 or TLS13"))),
    };
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(versions)?;
    let builder = match (t.client_auth_type, &t.client_ca_file) {
        (ClientAuth::NoClientCert, None) => builder.with_no_client_auth(),
        (ClientAuth::NoClientCert, Some(_)) => {
            return Err(Why::Said(
                "client_ca_file needs a client_auth_type that verifies".into(),
            ))
        }
        (_, None) => {
            return Err(Why::Said(format!(
                "client_auth_type {:?} needs client_ca_file",
                t.client_auth_type
            )))
        }
        (auth, Some(ca)) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(at(ca))
                .map_err(|e| Why::Said(format!("client_ca_file {}: {e}", at(ca).display())))?
            {
                let cert = cert
                    .map_err(|e| Why::Said(format!("client_ca_file {}: {e}", at(ca).display())))?;
                roots.add(cert)?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            );
            let verifier = if auth == ClientAuth::VerifyClientCertIfGiven {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            let verifier = verifier
                .build()
                .map_err(|e| Why::Said(format!("client_ca_file {}: {e}", at(ca).display())))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn write(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    /// A self-signed certificate and its key in `dir` (key 0600).
    pub(crate) fn self_signed(dir: &Path) -> String {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        write(dir, "metrics.key", &cert.key_pair.serialize_pem(), 0o600);
        write(dir, "metrics.crt", &cert.cert.pem(), 0o644);
        cert.cert.pem()
    }

    #[test]
    fn users_are_checked_against_their_bcrypt_hash() {
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = write(
            dir.path(),
            "web.yml",
            &format!("basic_auth_users:\n  prometheus: {hash}\n"),
            0o644,
        );
        let web = WebConfig::load(&path).unwrap();
        assert!(web.tls.is_none());
        let basic = |s: &str| {
            use base64::Engine;
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(s)
            )
        };
        assert!(web.admits(Some(basic("prometheus:s3cret").as_bytes())));
        for bad in ["prometheus:wrong", "other:s3cret", "prometheus", ""] {
            assert!(!web.admits(Some(basic(bad).as_bytes())), "{bad}");
        }
        assert!(!web.admits(None));
        assert!(!web.admits(Some(b"Bearer x")));
        assert!(!format!("{web:?}").contains(&hash));
        let open = WebConfig::new(None, BTreeMap::new());
        assert!(open.admits(None), "no users: no authentication");
    }

    #[tokio::test]
    async fn bcrypt_checks_are_few_at_once_and_a_passed_header_is_remembered() {
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        let web = Arc::new(WebConfig::new(
            None,
            [("p".to_string(), hash)].into_iter().collect(),
        ));
        let good = {
            use base64::Engine;
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode("p:s3cret")
            )
        };
        assert_eq!(web.admission(Some(b"Basic eDp5")).await, Admission::Out);
        // Every check taken: the next one is told to come back.
        let held: Vec<_> = (0..CHECKS)
            .map(|_| Arc::clone(&web.checks).try_acquire_owned().unwrap())
            .collect();
        assert_eq!(web.admission(Some(good.as_bytes())).await, Admission::Busy);
        drop(held);
        assert_eq!(web.admission(Some(good.as_bytes())).await, Admission::In);
        // Remembered: in without a check, even with every check taken.
        let _held: Vec<_> = (0..CHECKS)
            .map(|_| Arc::clone(&web.checks).try_acquire_owned().unwrap())
            .collect();
        assert_eq!(web.admission(Some(good.as_bytes())).await, Admission::In);
    }

    #[test]
    fn a_file_that_cannot_be_used_is_refused_naming_what() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        self_signed(d);
        let load = |text: &str| {
            let p = write(d, "web.yml", text, 0o644);
            WebConfig::load(&p)
                .map(|_| ())
                .map_err(|e| crate::error::chain(&e))
        };
        let tls = "tls_server_config:\n  cert_file: metrics.crt\n  key_file: metrics.key\n";
        assert_eq!(load(tls), Ok(()));
        for (text, said) in [
            (
                "tls_server_config:\n  cert_file: metrics.crt\n",
                "missing field `key_file`",
            ),
            ("tls_sever_config: {}\n", "unknown field `tls_sever_config`"),
            (
                "basic_auth_users:\n  p: plain\n",
                "basic_auth_users.p: not a bcrypt hash",
            ),
            (
                "http_server_config:\n  http2: false\n",
                "http_server_config is not supported",
            ),
            (
                "tls_server_config:\n  cert_file: nope.crt\n  key_file: metrics.key\n",
                "cert_file",
            ),
            (
                &format!("{tls}  client_auth_type: RequireAndVerifyClientCert\n"),
                "needs client_ca_file",
            ),
            (&format!("{tls}  min_version: TLS10\n"), "min_version TLS10"),
        ] {
            let e = load(text).unwrap_err();
            assert!(e.contains(said), "{text}: {e}");
            assert!(e.contains("--web.config.file"), "{e}");
        }
        std::fs::set_permissions(
            d.join("metrics.key"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let e = load(tls).unwrap_err();
        assert!(e.contains("others may read or write it"), "{e}");
    }
}
