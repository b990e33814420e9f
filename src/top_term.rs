//! `top`'s shell: the connection to the service (its socket, one view a
//! line as each cycle ends, then the hosts that changed; or its metrics
//! URL, asked every 5 s), or, while no service answers on the socket,
//! dry-run cycles of its own from the configuration file; the terminal
//! (ratatui over crossterm: raw mode and the alternate screen, put back on
//! quitting, on SIGTERM or SIGHUP, and on a panic; standard error muted
//! meanwhile) and the keyboard. What is drawn is [`crate::top`]'s.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ratatui::crossterm::event::{self, Event, KeyEventKind};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::top::Top;
use crate::view::View;
use crate::view_socket::{self, MAX_VIEW_BYTES};

/// How often a service that does not answer is asked again.
const RETRY: Duration = Duration::from_secs(1);

/// How often a metrics URL is asked (a view changes once a cycle; each
/// answer costs the service a write of the whole view).
const POLL: Duration = Duration::from_secs(5);

/// How long the hosts of cycles of its own have to close, once the
/// screen is gone.
const QUIT: Duration = Duration::from_millis(1500);

/// The fleet of cycles of its own while they run, and what must live as
/// long as its hosts, for `run` to close once the screen is gone.
type Looked = Arc<std::sync::Mutex<Option<(Arc<crate::fleet::Fleet>, Option<tempfile::TempDir>)>>>;

/// How often cycles of its own run where the configuration's interval is
/// zero (a cron run's, a replay's).
const OWN_EVERY: Duration = Duration::from_secs(30);

/// What the connection tells the screen.
enum Feed {
    View(Box<View>),
    Note(String),
    /// The views are top's own dry runs, or the service's.
    Own(bool),
}

/// Runs `top` against the service at `at` until the reader quits;
/// `Err` where there is no terminal or it fails.
///
/// # Errors
/// Standard output is not a terminal, or the terminal fails.
pub async fn run(args: crate::cli::TopArgs) -> std::io::Result<()> {
    use std::io::IsTerminal;
    if !std::io::stdout().is_terminal() {
        return Err(std::io::Error::other(
            "top needs a terminal (for a script or a pipe: genv-enforce status)",
        ));
    }
    let login = (args.credentials.as_deref().map(view_socket::credentials))
        .transpose()
        .map_err(|e| std::io::Error::other(crate::error::chain(&e)))?;
    let at = args.connect;
    // The configuration for cycles of its own: the one named, else, for
    // root, the service's where there is one (another user's top never
    // sweeps the fleet unasked).
    let root = rustix::process::geteuid().is_root();
    let look = args.config.or_else(|| {
        let shipped = PathBuf::from(crate::config_file::DEFAULT_PATH);
        (root && shipped.exists()).then_some(shipped)
    });
    let (tx, rx) = mpsc::channel(4);
    let stop = Arc::new(AtomicBool::new(false));
    let signals = tokio::spawn(stop_on_signals(Arc::clone(&stop)));
    let color = std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let note = format!("connecting to {}", view_socket::shown(&at));
    let mut ui = tokio::task::spawn_blocking(move || screen(rx, Top::new(note, color), &stop));
    // Fed here, not spawned: cycles of its own run on this task.
    let left = Looked::default();
    let ended = tokio::select! {
        ended = &mut ui => ended,
        () = feed(at, login, tx, look, Arc::clone(&left)) => ui.await,
    };
    // The screen is gone: the hosts of cycles of its own are closed.
    let looked = left.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some((fleet, keep)) = looked {
        let _ = tokio::time::timeout(QUIT, fleet.close()).await;
        drop(keep);
    }
    signals.abort();
    ended.unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
}

/// Sets `stop` on SIGTERM, SIGHUP or SIGINT.
async fn stop_on_signals(stop: Arc<AtomicBool>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut hup), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = hup.recv() => {}
        _ = int.recv() => {}
    }
    stop.store(true, Ordering::Relaxed);
}

/// The screen's loop: a redraw every quarter second (the countdowns) and
/// on each key or new view, until a quit key or `stop`.
fn screen(
    mut rx: mpsc::Receiver<Feed>,
    mut top: Top,
    stop: &Arc<AtomicBool>,
) -> std::io::Result<()> {
    // Raw mode and the alternate screen; its panic hook puts them back,
    // and a panic on any thread ends the screen too. What is said on
    // standard error meanwhile (by cycles of its own, their hosts' tools)
    // would tear the screen: muted, but for a panic's words.
    let mut terminal = ratatui::init();
    let muted = Arc::new(Muted::now());
    let hook = std::panic::take_hook();
    let stopped = Arc::clone(stop);
    let unmute = Arc::clone(&muted);
    std::panic::set_hook(Box::new(move |info| {
        stopped.store(true, Ordering::Relaxed);
        unmute.undo();
        hook(info);
    }));
    let ran = (|| loop {
        while let Ok(fed) = rx.try_recv() {
            match fed {
                Feed::View(v) => top.take(*v),
                Feed::Note(n) => top.say(n),
                Feed::Own(own) => top.own(own),
            }
        }
        terminal.draw(|f| top.draw(f, crate::clock::now_ms()))?;
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        if event::poll(Duration::from_millis(250))? {
            if let Event::Key(k) = event::read()? {
                if k.kind == KeyEventKind::Press && !top.key(k) {
                    return Ok(());
                }
            }
        }
    })();
    ratatui::restore();
    muted.undo();
    ran
}

/// Standard error sent to `/dev/null`, as it was before kept to be put
/// back.
struct Muted(Option<std::os::fd::OwnedFd>);

impl Muted {
    /// Standard error muted from now (as it was, where it cannot be).
    fn now() -> Self {
        use std::os::fd::AsFd;
        let saved = rustix::io::dup(std::io::stderr().as_fd()).ok();
        let null = std::fs::OpenOptions::new().write(true).open("/dev/null");
        match (saved, null) {
            (Some(saved), Ok(null)) if rustix::stdio::dup2_stderr(&null).is_ok() => {
                Muted(Some(saved))
            }
            _ => Muted(None),
        }
    }

    /// Standard error as it was.
    fn undo(&self) {
        if let Some(saved) = &self.0 {
            let _ = rustix::stdio::dup2_stderr(saved);
        }
    }
}

/// Feeds the screen the service's views at `at`, and says when none
/// comes; asks again every [`RETRY`]. While no service answers on a
/// socket, cycles of its own from the configuration at `look`, if any.
async fn feed(
    at: String,
    login: Option<(String, String)>,
    tx: mpsc::Sender<Feed>,
    mut look: Option<PathBuf>,
    left: Looked,
) {
    let url = at.starts_with("http://") || at.starts_with("https://");
    // Why cycles of its own could not run, said with every note after.
    let mut cannot: Option<String> = None;
    loop {
        if url {
            let fed = match view_socket::fetch(&at, login.as_ref(), Duration::from_secs(5)).await {
                Ok((view, _)) => Feed::View(Box::new(view)),
                Err(e) => Feed::Note(format!("{}; trying again", crate::error::chain(&e))),
            };
            if tx.send(fed).await.is_err() {
                return;
            }
            tokio::time::sleep(POLL).await;
            continue;
        }
        let stream = match tokio::net::UnixStream::connect(&at).await {
            Ok(s) => s,
            Err(e) => {
                let why = format!("no service answers at {at} ({e})");
                // Only where no service runs there (not one we may not
                // read: that is no reason to sweep the fleet).
                let none = matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                );
                if let (Some(path), true) = (&look, none) {
                    match own(path, &at, &why, &tx, &left).await {
                        Own::Attach => continue,
                        Own::Gone => return,
                        Own::Failed(how) => {
                            cannot = Some(format!(
                                "no cycles of its own from {}: {how}",
                                path.display()
                            ));
                            look = None;
                        }
                    }
                }
                let hint = match (&cannot, e.kind()) {
                    (_, std::io::ErrorKind::PermissionDenied) => {
                        "it is root's, or --view-group's: you may not read it".into()
                    }
                    (Some(how), _) => how.clone(),
                    (None, _) => "is it running with --view-socket? or --connect; or --config FILE for cycles of its own".into(),
                };
                let note = format!("{why}; trying again every {} s ({hint})", RETRY.as_secs());
                if tx.send(Feed::Note(note)).await.is_err() {
                    return;
                }
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        if tx
            .send(Feed::Note(format!("attached to {at}")))
            .await
            .is_err()
        {
            return;
        }
        let (from, mut to) = stream.into_split();
        // After the first view, only the hosts that changed (a delta).
        let _ = to.write_all(view_socket::DELTAS).await;
        let mut reader = tokio::io::BufReader::new(from);
        let mut line = Vec::new();
        let mut view: Option<View> = None;
        let why = loop {
            line.clear();
            match (&mut reader)
                .take(MAX_VIEW_BYTES)
                .read_until(b'\n', &mut line)
                .await
            {
                Ok(0) => break "the service went away".to_string(),
                Err(e) => break e.to_string(),
                Ok(_) => {}
            }
            if let Err(why) = taken(&mut view, &line) {
                break why;
            }
            if let Some(v) = &view {
                if tx.send(Feed::View(Box::new(v.clone()))).await.is_err() {
                    return;
                }
            }
        };
        if tx
            .send(Feed::Note(format!("{at}: {why}; trying again")))
            .await
            .is_err()
        {
            return;
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// How cycles of its own ended.
enum Own {
    /// A service answers at the socket now.
    Attach,
    /// The screen is gone.
    Gone,
    /// They could not run, and why.
    Failed(String),
}

/// Dry-run cycles of its own over the configuration at `path` (its hosts,
/// rules and policy: [`crate::setup::look`]), each view fed to the
/// screen, `why` none comes from `at`, until a service answers there.
async fn own(path: &Path, at: &str, why: &str, tx: &mpsc::Sender<Feed>, left: &Looked) -> Own {
    let file = path.to_path_buf();
    let (fleet, settings, keep) =
        match tokio::task::spawn_blocking(move || crate::setup::look(&file)).await {
            Ok(Ok(built)) => built,
            Ok(Err(e)) => return Own::Failed(crate::error::chain(&e)),
            Err(e) => return Own::Failed(e.to_string()),
        };
    let fleet = Arc::new(fleet);
    *left.lock().unwrap_or_else(|p| p.into_inner()) = Some((Arc::clone(&fleet), keep));
    let every = if settings.interval.is_zero() {
        OWN_EVERY
    } else {
        settings.interval
    };
    let options = crate::cycle::Options {
        view: true,
        dry_run: true,
        ..settings.cycle.clone()
    };
    // No state database in a look: its memory starts afresh.
    let mut memory = crate::service::remembered(&settings);
    let said = format!(
        "{why}: dry-run cycles of its own from {} every {}, nothing carried out",
        path.display(),
        humantime::format_duration(every)
    );
    let ended = 'cycles: {
        for feed in [Feed::Own(true), Feed::Note(said)] {
            if tx.send(feed).await.is_err() {
                break 'cycles Own::Gone;
            }
        }
        for n in 1.. {
            // The service looked for all along: a cycle it interrupts
            // acted on nothing.
            let (report, _) = tokio::select! {
                r = crate::cycle::cycle(&fleet, &options, n, &mut memory) => r,
                () = answers(at) => break 'cycles Own::Attach,
            };
            tokio::task::spawn_blocking(move || drop(report));
            let line = memory.view.take().map(|w| w.line(b""));
            if let Some(Ok(view)) = line.map(|l| serde_json::from_slice::<View>(&l)) {
                if tx.send(Feed::View(Box::new(view))).await.is_err() {
                    break 'cycles Own::Gone;
                }
            }
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = answers(at) => break 'cycles Own::Attach,
                () = tx.closed() => break 'cycles Own::Gone,
            }
        }
        Own::Gone
    };
    let _ = tx.send(Feed::Own(false)).await;
    // Closed here, or by `run` if the screen goes meanwhile (the slot is
    // emptied only once every host is closed).
    let _ = tokio::time::timeout(QUIT, fleet.close_said()).await;
    drop(left.lock().unwrap_or_else(|p| p.into_inner()).take());
    ended
}

/// When a service answers at `at`, asked every [`RETRY`].
async fn answers(at: &str) {
    loop {
        if tokio::net::UnixStream::connect(at).await.is_ok() {
            return;
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// `line` (a view, or a delta of the last one) into `view`.
fn taken(view: &mut Option<View>, line: &[u8]) -> Result<(), String> {
    let v = serde_json::from_slice::<View>(line).map_err(|e| format!("not a view: {e}"))?;
    match (view.as_mut(), v.delta_of) {
        (_, None) => *view = Some(v),
        (Some(last), Some(_)) => last.apply(v)?,
        (None, Some(base)) => return Err(format!("a delta of cycle {base} before any view")),
    }
    Ok(())
}
