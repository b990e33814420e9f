//! The running service's view of its last cycle ([`crate::view`]), for
//! `status` and `top`: kept written once per cycle on a [`Board`]
//! ([`crate::view_json`]), and served on a Unix socket (`--view-socket`;
//! root's alone, or a group's with `--view-group`) to whoever connects, as
//! one JSON line now and one per cycle after: the whole view, or, to a
//! reader that asked with [`DELTAS`], the hosts that changed. A reader can
//! never hold up a cycle or make the service allocate: every reader is
//! sent the same bytes, at most [`MAX_READERS`] at once, each write within
//! [`WRITE_DEADLINE`], and of what a reader sends only its first
//! [`DELTAS`]' length is kept.

use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Bytes;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::peer::Peer;
use crate::view::View;

/// Where the service serves its view, and `status` and `top` look for it
/// (the unit's runtime directory).
pub const DEFAULT_PATH: &str = "/run/genv-enforce/view.sock";

/// The most readers served at once; more are closed at once. Root (and
/// the service's own user) has [`ROOT_READERS`] of them to itself, and no
/// other user more than [`PER_USER`].
pub const MAX_READERS: usize = 16;

/// The readers kept for root: a group's members cannot crowd it out.
pub const ROOT_READERS: usize = 4;

/// The most readers one user other than root has at once (their
/// sub-uids, a rootless container's, counted as theirs).
pub const PER_USER: usize = 4;

/// A reader that takes longer than this to take one view is dropped.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(5);

/// The largest view a client reads (a fleet of thousands of hosts is a
/// few MiB).
pub const MAX_VIEW_BYTES: u64 = 256 << 20;

/// The last cycle's view, written, for every reader: the whole line,
/// made once when a reader first asks for it, and the delta from the
/// cycle before for readers that take deltas.
#[derive(Debug)]
pub struct Published {
    pub cycle: u64,
    written: Option<(crate::view_json::Written, Bytes)>,
    line: std::sync::OnceLock<Bytes>,
    /// The cycle before, and this view's delta from it.
    delta: Option<(u64, Bytes)>,
}

impl Published {
    /// The whole view, one JSON line.
    pub fn line(&self) -> Bytes {
        self.line
            .get_or_init(|| match &self.written {
                Some((w, extra)) => Bytes::from(w.line(extra)),
                None => Bytes::new(),
            })
            .clone()
    }

    /// What a reader is written next, the view of `sent` (the cycle last
    /// written to it) had: the delta where it changes that cycle's view
    /// and the reader takes deltas, else the whole view.
    pub fn for_reader(&self, sent: Option<u64>, deltas: bool) -> Bytes {
        match &self.delta {
            Some((base, delta)) if deltas && sent == Some(*base) => delta.clone(),
            _ => self.line(),
        }
    }
}

/// The last cycle's view, for every reader.
#[derive(Debug, Clone)]
pub struct Board(Arc<watch::Sender<Option<Arc<Published>>>>);

impl Default for Board {
    fn default() -> Self {
        Board(Arc::new(watch::channel(None).0))
    }
}

impl Board {
    /// Puts `written` up in place of the last view, with the service's
    /// own members `extra` ([`crate::view_json::members`]).
    pub fn publish(&self, written: crate::view_json::Written, extra: Bytes) {
        let delta = written.delta(&extra).map(|(b, d)| (b, Bytes::from(d)));
        self.0.send_replace(Some(Arc::new(Published {
            cycle: written.cycle,
            written: Some((written, extra)),
            line: std::sync::OnceLock::new(),
            delta,
        })));
    }

    /// Puts `view` up whole in place of the last one.
    pub fn publish_view(&self, view: &View) {
        let line = std::sync::OnceLock::new();
        let _ = line.set(Bytes::from(crate::view_json::line_of(view)));
        self.0.send_replace(Some(Arc::new(Published {
            cycle: view.cycle,
            written: None,
            line,
            delta: None,
        })));
    }

    /// The last view put up, one JSON line, if any.
    pub fn latest(&self) -> Option<Bytes> {
        let last = self.0.borrow().clone();
        last.map(|p| p.line())
    }

    fn subscribe(&self) -> watch::Receiver<Option<Arc<Published>>> {
        self.0.subscribe()
    }
}

/// What a reader sends, as its first line, to be written deltas
/// ([`View::delta_of`]) after its first view.
pub const DELTAS: &[u8] = b"deltas\n";

/// Why the socket cannot be served, or read.
#[derive(Debug, Error)]
pub enum ViewSocketError {
    #[error("{}: its directory: {source}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: crate::private::Refusal,
    },
    #[error("{}: not a socket: refused (remove it, or name another path)", .0.display())]
    NotSocket(PathBuf),
    #[error("{}: another service serves its view there", .0.display())]
    InUse(PathBuf),
    #[error("--view-group {0}: no such group")]
    NoGroup(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: no service answers there ({source}); is genv-enforce running with --view-socket? (or --connect another socket or the metrics URL)", path.display())]
    Unanswered {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {why}", from)]
    Bad { from: String, why: String },
}

/// A socket bound for [`serve`]; removed when dropped, unless another has
/// taken its place.
#[derive(Debug)]
pub struct Bound {
    listener: std::os::unix::net::UnixListener,
    path: PathBuf,
    id: (u64, u64),
}

impl Drop for Bound {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.file_type().is_socket() && (m.dev(), m.ino()) == self.id);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the socket at `path`, 0600 (0660 and owned by `group` if given),
/// in a directory only root (or we) may write, made 0755 if missing. A
/// stale socket there is replaced; a live one, or anything else, is left
/// alone and refused.
///
/// # Errors
/// The directory is missing and cannot be made, or is open to others; the
/// path holds something else, or a socket another service answers on; the
/// group is unknown; binding fails.
pub fn bind(path: &Path, group: Option<&str>) -> Result<Bound, ViewSocketError> {
    use std::os::unix::fs::DirBuilderExt;
    let io = |source| ViewSocketError::Io {
        path: path.to_path_buf(),
        source,
    };
    let given = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let refused = |source| ViewSocketError::Dir {
        path: given.to_path_buf(),
        source,
    };
    if std::fs::symlink_metadata(given).is_err() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(given)
            .map_err(|e| refused(e.into()))?;
    }
    // Resolved once: every step after works on the directory checked.
    let dir = std::fs::canonicalize(given).map_err(|e| refused(e.into()))?;
    crate::private::own_path(&dir, rustix::fs::FileType::Directory, 0o022).map_err(refused)?;
    crate::private::ancestors(&dir).map_err(refused)?;
    let Some(name) = path.file_name() else {
        return Err(io(std::io::Error::other("no file name")));
    };
    let path = dir.join(name);
    match std::fs::symlink_metadata(&path) {
        Ok(m) if !m.file_type().is_socket() => return Err(ViewSocketError::NotSocket(path)),
        Ok(_) if std::os::unix::net::UnixStream::connect(&path).is_ok() => {
            return Err(ViewSocketError::InUse(path))
        }
        _ => {}
    }
    let gid = match group {
        Some(g) => Some(
            nix::unistd::Group::from_name(g)
                .ok()
                .flatten()
                .ok_or_else(|| ViewSocketError::NoGroup(g.to_string()))?
                .gid,
        ),
        None => None,
    };
    // Bound in a directory of its own (0700: no one else can reach it
    // before its mode is set), then moved into place (over a stale
    // socket) at once.
    let private = tempfile::Builder::new()
        .prefix(".v")
        .tempdir_in(&dir)
        .map_err(io)?;
    let fresh = private.path().join("s");
    let listener = std::os::unix::net::UnixListener::bind(&fresh).map_err(io)?;
    let placed = (|| {
        if let Some(gid) = gid {
            std::os::unix::fs::chown(&fresh, None, Some(gid.as_raw()))?;
        }
        let mode = if gid.is_some() { 0o660 } else { 0o600 };
        std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&fresh, &path)?;
        listener.set_nonblocking(true)?;
        std::fs::symlink_metadata(&path)
    })();
    let m = placed.map_err(io)?;
    Ok(Bound {
        listener,
        path,
        id: (m.dev(), m.ino()),
    })
}

/// Serves `board` on `bound` until dropped: each reader gets the last view
/// at once (or the first, when it comes), then each new one.
pub async fn serve(bound: Bound, board: Board) {
    serve_under(bound, board, PathBuf::from("/etc/subuid")).await;
}

/// [`serve`], a user's sub-uids sharing their share as `subuid` ranges
/// them (a rootless container's many uids are its owner's).
async fn serve_under(bound: Bound, board: Board, subuid: PathBuf) {
    let listener = match bound
        .listener
        .try_clone()
        .and_then(tokio::net::UnixListener::from_std)
    {
        Ok(l) => l,
        Err(e) => {
            crate::output::complain(&format!(
                "--view-socket {}: {e}: enforcing without the view",
                bound.path.display()
            ));
            return;
        }
    };
    let root = Arc::new(tokio::sync::Semaphore::new(ROOT_READERS));
    let others = Arc::new(tokio::sync::Semaphore::new(MAX_READERS - ROOT_READERS));
    let per_user: Arc<std::sync::Mutex<HashMap<Peer, usize>>> = Arc::default();
    let me = rustix::process::geteuid().as_raw();
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "view socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Who connects, as the kernel says; full: closed at once rather
        // than left waiting.
        let Ok(uid) = stream.peer_cred().map(|c| c.uid()) else {
            continue;
        };
        let pool = if uid == 0 || uid == me {
            &root
        } else {
            &others
        };
        let Ok(slot) = Arc::clone(pool).try_acquire_owned() else {
            continue;
        };
        let share = (uid != 0 && uid != me).then(|| crate::peer::of_uid(uid, &subuid));
        if let Some(peer) = &share {
            let mut held = per_user.lock().expect("not poisoned");
            let n = held.entry(peer.clone()).or_default();
            if *n >= PER_USER {
                continue;
            }
            *n += 1;
        }
        let views = board.subscribe();
        let per_user = Arc::clone(&per_user);
        tokio::spawn(async move {
            read_to(stream, views).await;
            drop(slot);
            if let Some(peer) = share {
                let mut held = per_user.lock().expect("not poisoned");
                if let Some(n) = held.get_mut(&peer) {
                    *n -= 1;
                    if *n == 0 {
                        held.remove(&peer);
                    }
                }
            }
        });
    }
}

/// One reader: every view as it comes (deltas, once it asked for them
/// with [`DELTAS`]), until it leaves or falls behind.
async fn read_to(
    stream: tokio::net::UnixStream,
    mut views: watch::Receiver<Option<Arc<Published>>>,
) {
    let (mut from, mut to) = stream.into_split();
    let mut junk = [0u8; 512];
    // Its first line, up to DELTAS's length: the rest is dropped.
    let mut said = Vec::with_capacity(DELTAS.len());
    let mut sent = None;
    loop {
        let last = views.borrow_and_update().clone();
        if let Some(p) = last {
            let line = p.for_reader(sent, said == DELTAS);
            match tokio::time::timeout(WRITE_DEADLINE, to.write_all(&line)).await {
                Ok(Ok(())) => sent = Some(p.cycle),
                _ => return,
            }
        }
        // Until the next view: what the reader sends is dropped (but its
        // first line), its end ends it.
        loop {
            tokio::select! {
                changed = views.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    break;
                }
                read = from.read(&mut junk) => {
                    let Ok(n @ 1..) = read else {
                        return;
                    };
                    let room = DELTAS.len() - said.len();
                    said.extend_from_slice(&junk[..n.min(room)]);
                }
            }
        }
    }
}

/// `at` as said in messages: a URL without its password.
pub fn shown(at: &str) -> String {
    match url::Url::parse(at) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => at.to_string(),
    }
}

/// `USER:PASSWORD` for the metrics endpoint's basic authentication, from
/// a file only we may read (`--credentials`): never on a command line.
///
/// # Errors
/// The file is refused, or holds no `USER:PASSWORD`.
pub fn credentials(path: &Path) -> Result<(String, String), ViewSocketError> {
    let bad = |why: String| ViewSocketError::Bad {
        from: path.display().to_string(),
        why,
    };
    let text = crate::private::read_secret(path).map_err(|e| bad(e.to_string()))?;
    let line = text.lines().next().unwrap_or("").trim();
    match line.split_once(':') {
        Some((u, p)) if !u.is_empty() => Ok((u.to_string(), p.to_string())),
        _ => Err(bad("not USER:PASSWORD".into())),
    }
}

/// The view a service serves at `at`: a Unix socket's path, or the
/// metrics endpoint's URL (`http(s)://host:port`, its path `/view`, with
/// `login`'s basic authentication), within `timeout`.
///
/// # Errors
/// Nothing answers, too late, or what comes is not a view.
pub async fn fetch(
    at: &str,
    login: Option<&(String, String)>,
    timeout: Duration,
) -> Result<(View, Bytes), ViewSocketError> {
    let bad = |why: String| ViewSocketError::Bad {
        from: shown(at),
        why,
    };
    let line = if at.starts_with("http://") || at.starts_with("https://") {
        let mut url = url::Url::parse(at).map_err(|e| bad(e.to_string()))?;
        if url.path() == "/" {
            url.set_path("/view");
        }
        let (user, password) = (url.username().to_string(), url.password().map(String::from));
        let _ = url.set_username("");
        let _ = url.set_password(None);
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| bad(e.to_string()))?;
        let mut req = client.get(url);
        if let Some((user, password)) = login {
            req = req.basic_auth(user, Some(password));
        } else if !user.is_empty() {
            req = req.basic_auth(user, password);
        }
        let mut resp = req
            .send()
            .await
            .map_err(|e| bad(crate::error::chain(&e.without_url())))?;
        if !resp.status().is_success() {
            return Err(bad(format!("HTTP {}", resp.status())));
        }
        // Read to MAX_VIEW_BYTES at most, whatever the endpoint says.
        let mut body = Vec::new();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| bad(e.without_url().to_string()))?
        {
            if body.len() + chunk.len() > MAX_VIEW_BYTES as usize {
                return Err(bad(format!("more than {MAX_VIEW_BYTES} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        Bytes::from(body)
    } else {
        let path = PathBuf::from(at);
        let unanswered = |source| ViewSocketError::Unanswered {
            path: path.clone(),
            source,
        };
        let read = async {
            let stream = tokio::net::UnixStream::connect(&path)
                .await
                .map_err(unanswered)?;
            let mut line = Vec::new();
            let mut limited = tokio::io::BufReader::new(stream).take(MAX_VIEW_BYTES);
            tokio::io::AsyncBufReadExt::read_until(&mut limited, b'\n', &mut line)
                .await
                .map_err(unanswered)?;
            Ok::<_, ViewSocketError>(Bytes::from(line))
        };
        tokio::time::timeout(timeout, read).await.map_err(|_| {
            bad(format!(
                "no view within {} s (the service's first cycle may not have ended)",
                timeout.as_secs()
            ))
        })??
    };
    let view: View = serde_json::from_slice(&line).map_err(|e| bad(format!("not a view: {e}")))?;
    Ok((view, line))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::CycleReport;
    use tokio::io::AsyncBufReadExt;

    fn view(cycle: u64) -> View {
        View {
            schema: crate::view::SCHEMA,
            cycle,
            at_ms: Some(1),
            dry_run: true,
            hosts: Vec::new(),
            users: Vec::new(),
            groups: Vec::new(),
            waiting: Vec::new(),
            counted_left_out: 0,
            waiting_left_out: 0,
            actions_left_out: 0,
            actions: Vec::new(),
            recent: Vec::new(),
            notifications: Vec::new(),
            delta_of: None,
            changed: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_reader_gets_the_last_view_then_each_new_one_and_the_socket_is_root_s() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/view.sock");
        let bound = bind(&path, None).unwrap();
        let m = std::fs::metadata(&path).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        let made = std::fs::metadata(path.parent().unwrap()).unwrap();
        assert_eq!(made.permissions().mode() & 0o777, 0o755);
        let board = Board::default();
        board.publish_view(&view(1));
        let server = tokio::spawn(serve(bound, board.clone()));
        let (got, _) = fetch(path.to_str().unwrap(), None, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(got.cycle, 1);
        let stream = tokio::net::UnixStream::connect(&path).await.unwrap();
        let mut lines = tokio::io::BufReader::new(stream).lines();
        assert!(lines
            .next_line()
            .await
            .unwrap()
            .unwrap()
            .contains("\"cycle\":1"));
        board.publish_view(&view(2));
        assert!(lines
            .next_line()
            .await
            .unwrap()
            .unwrap()
            .contains("\"cycle\":2"));
        // A second service refuses the live socket; a stale one is replaced.
        assert!(matches!(bind(&path, None), Err(ViewSocketError::InUse(_))));
        server.abort();
        let _ = server.await;
        assert!(!path.exists(), "removed with its service");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let again = bind(&path, None).unwrap();
        drop(again);
        assert!(!path.exists());
    }

    type Lines = tokio::io::Lines<tokio::io::BufReader<tokio::net::UnixStream>>;

    /// The next line `lines` reads, a view.
    async fn next(lines: &mut Lines) -> View {
        let got = tokio::time::timeout(Duration::from_secs(5), lines.next_line());
        serde_json::from_str(&got.await.unwrap().unwrap().unwrap()).unwrap()
    }

    /// A reader that asks for deltas is sent, after its first view, the
    /// hosts that changed, which make the next view from the last; one
    /// that does not, or that missed a cycle, the whole view.
    #[tokio::test]
    async fn a_reader_that_asks_gets_deltas_and_one_that_missed_a_cycle_the_whole() {
        use crate::view::tests::{counted_on, recorded};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("view.sock");
        let bound = bind(&path, None).unwrap();
        let board = Board::default();
        let (mut report, mut cluster, policy) = recorded();
        let mut writer = crate::view_json::Writer::default();
        let mut cycle = |report: &CycleReport, cluster: &crate::model::Cluster| {
            let counted = counted_on(cluster, &policy);
            let w = writer.write(report, cluster, &counted, &policy, Some(1));
            board.publish(w, Bytes::new());
        };
        cycle(&report, &cluster);
        let server = tokio::spawn(serve(bound, board.clone()));
        let reader = |deltas: bool| {
            let path = path.clone();
            async move {
                let mut s = tokio::net::UnixStream::connect(&path).await.unwrap();
                if deltas {
                    s.write_all(DELTAS).await.unwrap();
                }
                tokio::io::BufReader::new(s).lines()
            }
        };
        let mut asks = reader(true).await;
        let mut plain = reader(false).await;

        let mut seen = next(&mut asks).await;
        assert_eq!(seen.delta_of, None);
        assert_eq!(next(&mut plain).await.delta_of, None);
        // What the reader sent is read before the next view.
        tokio::time::sleep(Duration::from_millis(200)).await;
        report.cycle = 2;
        cluster.hosts[2].1.processes.pop();
        cycle(&report, &cluster);
        let delta = next(&mut asks).await;
        assert_eq!(delta.delta_of, Some(1));
        assert_eq!(delta.changed.len(), 1);
        seen.apply(delta).unwrap();
        let whole = next(&mut plain).await;
        assert_eq!(whole.delta_of, None);
        assert_eq!(seen, whole);
        // Two cycles before its writer runs again (one thread: no await
        // between them): the board keeps the last, whose delta is from a
        // cycle it was not sent: the whole view.
        report.cycle = 3;
        cycle(&report, &cluster);
        report.cycle = 4;
        cycle(&report, &cluster);
        let later = next(&mut asks).await;
        assert_eq!((later.cycle, later.delta_of), (4, None));
        assert_eq!(later.hosts.len(), 3);
        server.abort();
    }

    #[test]
    fn what_is_not_a_socket_or_sits_in_an_open_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("view.sock");
        std::fs::write(&path, "hers").unwrap();
        assert!(matches!(
            bind(&path, None),
            Err(ViewSocketError::NotSocket(_))
        ));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "hers");
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = bind(&open.join("view.sock"), None).unwrap_err();
        assert!(matches!(e, ViewSocketError::Dir { .. }), "{e}");
        let e = bind(&dir.path().join("g.sock"), Some("no-such-group-here")).unwrap_err();
        assert!(matches!(e, ViewSocketError::NoGroup(_)), "{e}");
    }

    /// One user's sub-uids (a rootless container's many uids) share that
    /// user's readers; another user's are their own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_users_sub_uids_share_their_readers() {
        use std::io::BufRead;
        use std::os::unix::process::CommandExt;
        if !rustix::process::geteuid().is_root() {
            assert!(
                std::env::var_os("GENV_ENFORCE_CI").is_none(),
                "readers of other uids need root, in CI"
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join("view.sock");
        let bound = bind(&path, None).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let subuid = dir.path().join("subuid");
        std::fs::write(&subuid, "bob:200000:65536\ncarol:300000:65536\n").unwrap();
        let board = Board::default();
        board.publish_view(&view(1));
        let server = tokio::spawn(serve_under(bound, board, subuid));
        // A reader as `uid`: whether it is served a view or closed.
        const READ: &str = "import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.settimeout(5)
try:
    got = s.recv(1)
except OSError:
    got = b''
print('served' if got else 'closed', flush=True)
time.sleep(30)
";
        let mut readers = Vec::new();
        let mut said = Vec::new();
        for uid in [
            200_000, 200_001, 200_002, 200_003, 200_004, 200_005, 300_000,
        ] {
            let mut child = std::process::Command::new("python3")
                .args(["-c", READ, path.to_str().unwrap()])
                .uid(uid)
                .gid(uid)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let out = child.stdout.take().unwrap();
            let line = tokio::task::spawn_blocking(move || {
                let mut line = String::new();
                std::io::BufReader::new(out).read_line(&mut line).unwrap();
                line
            });
            said.push(line.await.unwrap().trim().to_string());
            readers.push(child);
        }
        for mut r in readers {
            let _ = r.kill();
            let _ = r.wait();
        }
        server.abort();
        let served: Vec<&str> = ["served"; PER_USER].into();
        assert_eq!(said[..PER_USER], served, "bob's first {PER_USER}");
        assert_eq!(
            said[PER_USER..6],
            ["closed", "closed"],
            "bob's past his share"
        );
        assert_eq!(said[6], "served", "carol's own share");
    }

    #[tokio::test]
    async fn readers_past_the_limit_are_closed_and_one_that_never_reads_holds_up_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("view.sock");
        let bound = bind(&path, None).unwrap();
        let board = Board::default();
        // A view larger than any socket buffer.
        let mut big = view(1);
        big.users = (0..20_000)
            .map(|k| crate::view::UserView {
                user: format!("user{k}"),
                devices: 1,
                memory_bytes: 1,
                processes: 1,
                counted: None,
                counted_idle: None,
                device_cap: None,
                memory_cap: None,
            })
            .collect();
        board.publish_view(&big);
        let server = tokio::spawn(serve(bound, board.clone()));
        // Root's own readers (this test runs as the service's user).
        let mut held = Vec::new();
        for _ in 0..ROOT_READERS {
            held.push(tokio::net::UnixStream::connect(&path).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut over = tokio::net::UnixStream::connect(&path).await.unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), over.read(&mut buf))
            .await
            .expect("closed at once")
            .unwrap_or(0);
        assert_eq!(n, 0, "closed without a view");
        // Publishing never waits on them.
        let t = std::time::Instant::now();
        for k in 2..10 {
            big.cycle = k;
            board.publish_view(&big);
        }
        assert!(t.elapsed() < Duration::from_secs(5));
        // Past the write deadline they are dropped, and a reader is served.
        drop(held.split_off(1));
        tokio::time::sleep(WRITE_DEADLINE + Duration::from_secs(1)).await;
        let (got, _) = fetch(path.to_str().unwrap(), None, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(got.cycle, 9);
        server.abort();
    }
}
