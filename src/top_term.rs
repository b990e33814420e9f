//! `top`'s shell: the connection to the service (its socket, one view a
//! line as each cycle ends; or its metrics URL, asked every second), the
//! terminal (ratatui over crossterm: raw mode and the alternate screen,
//! put back on quitting, on SIGTERM or SIGHUP, and on a panic) and the
//! keyboard. What is drawn is [`crate::top`]'s.

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

/// What the connection tells the screen.
enum Feed {
    View(Box<View>),
    Note(String),
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
    let (tx, rx) = mpsc::channel(4);
    let feed = tokio::spawn(feed(at.clone(), login, tx));
    let stop = Arc::new(AtomicBool::new(false));
    let signals = tokio::spawn(stop_on_signals(Arc::clone(&stop)));
    let color = std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let note = format!("connecting to {}", view_socket::shown(&at));
    let ui = tokio::task::spawn_blocking(move || screen(rx, Top::new(note, color), &stop));
    let ended = ui
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
    feed.abort();
    signals.abort();
    ended
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
    // and a panic on any thread ends the screen too.
    let mut terminal = ratatui::init();
    let hook = std::panic::take_hook();
    let stopped = Arc::clone(stop);
    std::panic::set_hook(Box::new(move |info| {
        stopped.store(true, Ordering::Relaxed);
        hook(info);
    }));
    let ran = (|| loop {
        while let Ok(fed) = rx.try_recv() {
            match fed {
                Feed::View(v) => top.take(*v),
                Feed::Note(n) => top.say(n),
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
    ran
}

/// Feeds the screen the service's views at `at`, and says when none
/// comes; asks again every [`RETRY`].
async fn feed(at: String, login: Option<(String, String)>, tx: mpsc::Sender<Feed>) {
    let url = at.starts_with("http://") || at.starts_with("https://");
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
                let note = format!(
                    "no service answers at {at} ({e}); trying again every {} s (is it running with --view-socket? or --connect)",
                    RETRY.as_secs()
                );
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
