//! `top`'s screen: the service's views as they come, drawn with ratatui.
//! Pure: a [`Top`] takes views and keys and draws a frame for a given
//! time (each deadline's countdown); the terminal, the keyboard and the
//! connection are [`crate::top_term`]'s.
//!
//! Four tabs: the fleet (a host a row, each GPU a mark: `.` free, `e` in
//! an environment, `i` held idle, `S` a stray, `V` violating, `W` an
//! action waits), the users (GPUs and memory against their caps, what
//! waits on them), what waits (with countdowns) and what was done (the
//! service's last actions, or the cycles' top has seen). A filter
//! (`/`), a sort (`s`), a detail pane (Enter) that says why, help (`?`).

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Row, Table, TableState, Tabs, Wrap};
use ratatui::Frame;

use crate::report::clean;
use crate::view::{ActionView, GpuState, GroupView, HostState, HostView, UserView, View};
use crate::view_text::span;

/// How many done actions are kept from the views seen.
pub const RECENT: usize = crate::view::RECENT;

/// The tabs, in key order (`1` to `4`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tab {
    Fleet,
    Users,
    Waiting,
    Actions,
}

const TABS: [(Tab, &str); 4] = [
    (Tab::Fleet, "1 fleet"),
    (Tab::Users, "2 users"),
    (Tab::Waiting, "3 waiting"),
    (Tab::Actions, "4 actions"),
];

/// How rows are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sort {
    /// By name (host, user) or time (actions).
    Name,
    /// The most pressing first: violations, waits, most GPUs.
    Pressing,
}

/// What `top` shows and where the reader is.
#[derive(Debug)]
pub struct Top {
    view: Option<View>,
    tab: Tab,
    sort: Sort,
    filter: String,
    typing: bool,
    selected: usize,
    detail: bool,
    help: bool,
    /// Where the views come from, or why none comes.
    note: String,
    /// The views are top's own dry runs (no service answers).
    own: bool,
    color: bool,
}

impl Top {
    /// A screen with no view yet; `note` says where it looks; `color`
    /// unless `NO_COLOR`.
    pub fn new(note: String, color: bool) -> Self {
        Top {
            view: None,
            tab: Tab::Fleet,
            sort: Sort::Name,
            filter: String::new(),
            typing: false,
            selected: 0,
            detail: false,
            help: false,
            note,
            own: false,
            color,
        }
    }

    /// Says whether the views are top's own dry runs, no service
    /// answering: a view from before is let go either way.
    pub fn own(&mut self, own: bool) {
        if own != self.own {
            self.view = None;
        }
        self.own = own;
    }

    /// Takes the service's latest view.
    pub fn take(&mut self, view: View) {
        self.view = Some(view);
    }

    /// The actions tab's rows with their cycles: the service's recent
    /// actions, or, from a dry run (which carries out nothing), what its
    /// cycle would do.
    fn recent(&self) -> Vec<(u64, &ActionView)> {
        match &self.view {
            None => Vec::new(),
            Some(v) if v.dry_run => (v.actions.iter().take(RECENT))
                .map(|a| (v.cycle, a))
                .collect(),
            Some(v) => (v.recent.iter().take(RECENT))
                .map(|d| (d.cycle, &d.action))
                .collect(),
        }
    }

    /// Says where views come from, or why none comes.
    pub fn say(&mut self, note: String) {
        self.note = note;
    }

    /// Takes a key; `false` once it asks to quit.
    pub fn key(&mut self, k: KeyEvent) -> bool {
        let ctrl_c = k.modifiers.contains(KeyModifiers::CONTROL) && k.code == KeyCode::Char('c');
        if ctrl_c {
            return false;
        }
        if self.typing {
            match k.code {
                KeyCode::Enter => self.typing = false,
                KeyCode::Esc => {
                    self.typing = false;
                    self.filter.clear();
                }
                KeyCode::Backspace => {
                    self.filter.pop();
                }
                KeyCode::Char(c) if self.filter.len() < 64 => self.filter.push(c),
                _ => {}
            }
            self.selected = 0;
            return true;
        }
        if self.help {
            self.help = false;
            return !matches!(k.code, KeyCode::Char('q'));
        }
        match k.code {
            KeyCode::Char('q') => return false,
            KeyCode::Esc if self.detail => self.detail = false,
            KeyCode::Esc if !self.filter.is_empty() => self.filter.clear(),
            KeyCode::Esc => return false,
            KeyCode::Char('?') => self.help = true,
            KeyCode::Char('/') => self.typing = true,
            KeyCode::Char('s') => {
                self.sort = match self.sort {
                    Sort::Name => Sort::Pressing,
                    Sort::Pressing => Sort::Name,
                }
            }
            KeyCode::Enter => self.detail = !self.detail,
            KeyCode::Down | KeyCode::Char('j') => self.selected = self.selected.saturating_add(1),
            KeyCode::Up | KeyCode::Char('k') => self.selected = self.selected.saturating_sub(1),
            KeyCode::PageDown => self.selected = self.selected.saturating_add(20),
            KeyCode::PageUp => self.selected = self.selected.saturating_sub(20),
            KeyCode::Home | KeyCode::Char('g') => self.selected = 0,
            KeyCode::Tab => self.switch(self.tab_index() + 1),
            KeyCode::BackTab => self.switch(self.tab_index() + TABS.len() - 1),
            KeyCode::Char(c @ '1'..='4') => self.switch(c as usize - '1' as usize),
            _ => {}
        }
        true
    }

    fn tab_index(&self) -> usize {
        TABS.iter().position(|(t, _)| *t == self.tab).unwrap_or(0)
    }

    fn switch(&mut self, i: usize) {
        self.tab = TABS[i % TABS.len()].0;
        self.selected = 0;
        self.detail = false;
    }

    fn style(&self, s: Style) -> Style {
        if self.color {
            s
        } else {
            Style::default().add_modifier(s.add_modifier & (Modifier::BOLD | Modifier::REVERSED))
        }
    }

    /// Draws the screen as at `now` (ms since the Unix epoch).
    pub fn draw(&self, f: &mut Frame, now: u64) {
        let [head, tabs, body, foot] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(1),
            Constraint::Min(1),
            Constraint::Length(1),
        ])
        .areas(f.area());
        f.render_widget(Paragraph::new(self.headline(now)), head);
        let titles: Vec<&str> = TABS.iter().map(|(_, t)| *t).collect();
        f.render_widget(
            Tabs::new(titles)
                .select(self.tab_index())
                .highlight_style(self.style(Style::default().add_modifier(Modifier::REVERSED))),
            tabs,
        );
        let rows = self.rows(now);
        let chosen = self.selected.min(rows.len().saturating_sub(1));
        let (list, pane) = if self.detail && !rows.is_empty() {
            let [l, p] =
                Layout::vertical([Constraint::Percentage(55), Constraint::Min(4)]).areas(body);
            (l, Some(p))
        } else {
            (body, None)
        };
        self.table(f, list, &rows, chosen);
        if let (Some(pane), Some(row)) = (pane, rows.get(chosen)) {
            let text: Vec<Line> = self
                .detail(row.at, now)
                .into_iter()
                .map(|l| Line::from(clean(&l).into_owned()))
                .collect();
            f.render_widget(
                Paragraph::new(text)
                    .wrap(Wrap { trim: false })
                    .block(Block::default().borders(Borders::TOP).title(" why ")),
                pane,
            );
        }
        f.render_widget(Paragraph::new(self.footline(rows.len())), foot);
        if self.help {
            help(f, body);
        }
    }

    fn headline(&self, now: u64) -> Line<'static> {
        let Some(v) = &self.view else {
            return Line::from(format!("genv-enforce top: {}", clean(&self.note)));
        };
        let count = |s: HostState| v.hosts.iter().filter(|h| h.state == s).count();
        let gpus: usize = v.hosts.iter().map(|h| h.gpus.len()).sum();
        let age = v.at_ms.map_or_else(
            || "a replay".into(),
            |at| format!("{} ago", span(now.saturating_sub(at))),
        );
        let mut spans = vec![Span::raw(format!(
            "cycle {} ({age}): {} hosts, {} ok, {} degraded, {} failed; {gpus} GPUs; {} waiting",
            v.cycle,
            v.hosts.len(),
            count(HostState::Ok),
            count(HostState::Degraded),
            count(HostState::Failed),
            v.waiting.len()
        ))];
        if v.dry_run {
            let said = if self.own {
                "  TOP'S OWN DRY RUN, no service answers: nothing is carried out"
            } else {
                "  DRY RUN: nothing is carried out"
            };
            spans.push(Span::styled(
                said,
                self.style(
                    Style::default()
                        .fg(Color::Yellow)
                        .add_modifier(Modifier::BOLD),
                ),
            ));
        }
        Line::from(spans)
    }

    fn footline(&self, n: usize) -> Line<'static> {
        if self.typing {
            return Line::from(format!(
                "/{}_  (Enter keeps it, Esc clears it)",
                self.filter
            ));
        }
        let sort = match self.sort {
            Sort::Name => "name",
            Sort::Pressing => "most pressing",
        };
        let filter = if self.filter.is_empty() {
            String::new()
        } else {
            format!(" filter /{}", self.filter)
        };
        let left_out = match (&self.view, self.tab) {
            (Some(v), Tab::Waiting) => v.waiting_left_out,
            (Some(v), Tab::Actions) if v.dry_run => v.actions_left_out,
            _ => 0,
        };
        let more = match (&self.view, self.tab, left_out) {
            (Some(v), Tab::Users, _) => (v.counted_left_out_said())
                .map(|s| format!(" {s}"))
                .unwrap_or_default(),
            (.., 0) => String::new(),
            (.., n) => format!(
                " (and {n} more, over {} a host)",
                crate::view::MAX_HOST_ACTIONS
            ),
        };
        Line::from(format!(
            "{n} rows{more}{filter}, by {sort} | ? help  / filter  s sort  Enter why  q quit | {}",
            clean(&self.note)
        ))
    }

    fn table(&self, f: &mut Frame, area: Rect, rows: &[Shown], chosen: usize) {
        // Each tab's columns and widths (the last takes what is left).
        let (header, widths): ([&str; 5], [u16; 5]) = match self.tab {
            Tab::Fleet => (["HOST", "STATE", "GPUS", "JOBS", "WHY"], [20, 9, 18, 5, 10]),
            Tab::Users => (
                ["USER", "GPUS", "MEMORY", "JOBS", "WAITING"],
                [16, 10, 22, 5, 7],
            ),
            Tab::Waiting => (
                ["HOST", "ACTION", "RULES", "DUE", "OWNER"],
                [20, 24, 28, 14, 8],
            ),
            Tab::Actions => (
                ["CYCLE", "HOST", "ACTION", "RULES", "RESULT"],
                [6, 20, 24, 28, 8],
            ),
        };
        let widths = widths.iter().enumerate().map(|(i, w)| match i {
            4 => Constraint::Min(*w),
            _ => Constraint::Length(*w),
        });
        // Only what fits is built into cells.
        let height = usize::from(area.height.saturating_sub(1)).max(1);
        let first = chosen.saturating_sub(height - 1);
        let shown = rows.iter().skip(first).take(height).map(|r| {
            let cells: Vec<Line> = (r.cells.iter().enumerate())
                .map(|(i, c)| match (self.tab, i) {
                    (Tab::Fleet, 2) => self.marks(c),
                    _ => Line::from(clean(c).into_owned()),
                })
                .collect();
            Row::new(cells).style(self.style(r.tone))
        });
        let mut state = TableState::default().with_selected(Some(chosen - first));
        let table = Table::new(shown, widths)
            .header(
                Row::new(header.iter().copied())
                    .style(self.style(Style::default().add_modifier(Modifier::BOLD))),
            )
            .row_highlight_style(self.style(Style::default().add_modifier(Modifier::REVERSED)));
        f.render_stateful_widget(table, area, &mut state);
    }

    /// A host's GPU marks, each coloured by its state.
    fn marks(&self, marks: &str) -> Line<'static> {
        let spans: Vec<Span> = marks
            .chars()
            .map(|c| {
                let colour = match c {
                    'V' => Color::Red,
                    'W' => Color::Magenta,
                    'S' => Color::Yellow,
                    'e' => Color::Green,
                    'i' => Color::Cyan,
                    _ => Color::DarkGray,
                };
                Span::styled(c.to_string(), self.style(Style::default().fg(colour)))
            })
            .collect();
        Line::from(spans)
    }

    /// The detail pane of row `at` of the current tab: why it stands
    /// where it stands.
    fn detail(&self, at: usize, now: u64) -> Vec<String> {
        match (&self.view, self.tab) {
            (_, Tab::Actions) => self.recent().get(at).map(|(c, a)| done_detail(*c, a)),
            (None, _) => None,
            (Some(v), Tab::Fleet) => v.hosts.get(at).map(|h| host_detail(h, v)),
            (Some(v), Tab::Users) => match v.users.get(at) {
                Some(u) => Some(user_detail(u, v)),
                None => (v.groups.get(at - v.users.len())).map(|g| group_detail(g, v)),
            },
            (Some(v), Tab::Waiting) => v.waiting.get(at).map(|a| waiting_detail(a, now)),
        }
        .unwrap_or_default()
    }

    /// The current tab's rows, filtered and sorted.
    fn rows(&self, now: u64) -> Vec<Shown> {
        let mut rows: Vec<Shown> = match (&self.view, self.tab) {
            (_, Tab::Actions) => self.recent().into_iter().map(|(c, a)| done(c, a)).collect(),
            (None, _) => Vec::new(),
            (Some(v), Tab::Fleet) => v.hosts.iter().map(host).collect(),
            (Some(v), Tab::Users) => {
                let waits = waits_by_owner(v);
                let of = |u: &UserView| waits.get(u.user.as_str()).copied().unwrap_or(0);
                let users = v.users.iter().map(|u| user(u, of(u)));
                users.chain(v.groups.iter().map(group)).collect()
            }
            (Some(v), Tab::Waiting) => v.waiting.iter().map(|a| waiting(a, now)).collect(),
        };
        for (at, r) in rows.iter_mut().enumerate() {
            r.at = at;
        }
        if !self.filter.is_empty() {
            let needle = self.filter.to_lowercase();
            rows.retain(|r| r.text().to_lowercase().contains(&needle));
        }
        if self.sort == Sort::Pressing {
            rows.sort_by_key(|r| std::cmp::Reverse(r.weight));
        }
        rows
    }
}

/// One row: its cells, how pressing it is, its tone, and where it comes
/// from in its list (its detail is made only for the row chosen).
#[derive(Debug)]
struct Shown {
    cells: Vec<String>,
    weight: u64,
    tone: Style,
    at: usize,
}

impl Shown {
    fn text(&self) -> String {
        self.cells.join(" ")
    }
}

fn host(h: &HostView) -> Shown {
    let marks: String = (h.gpus.iter())
        .map(|g| match g.state {
            GpuState::Free => '.',
            GpuState::InEnv => 'e',
            GpuState::Idle => 'i',
            GpuState::Stray => 'S',
            GpuState::Violating => 'V',
            GpuState::Waiting => 'W',
        })
        .collect();
    let jobs: usize = h.gpus.iter().map(|g| g.processes.len()).sum();
    let (state, tone) = match h.state {
        HostState::Ok => ("ok", Style::default()),
        HostState::Degraded => ("degraded", Style::default().fg(Color::Yellow)),
        HostState::Failed => ("failed", Style::default().fg(Color::Red)),
    };
    let pressing = h.gpus.iter().map(|g| g.state as u64).max().unwrap_or(0);
    Shown {
        cells: vec![
            h.host.clone(),
            state.into(),
            marks,
            jobs.to_string(),
            h.why.clone().unwrap_or_default(),
        ],
        weight: (u64::from(h.state != HostState::Ok) << 8) | pressing,
        tone,
        at: 0,
    }
}

fn host_detail(h: &HostView, v: &View) -> Vec<String> {
    let mut detail = Vec::new();
    let state = match h.state {
        HostState::Ok => "ok",
        HostState::Degraded => "degraded",
        HostState::Failed => "failed",
    };
    if let Some(why) = &h.why {
        detail.push(format!("{} is {state}: {why}", h.host));
    }
    for g in &h.gpus {
        let envs = if g.envs.is_empty() {
            "no environment attached".to_string()
        } else {
            format!("attached to {}", g.envs_listed())
        };
        let more = g.envs_more();
        detail.push(format!("gpu {}: {}, {envs}{more}", g.index, gpu_state(g)));
        for p in &g.processes {
            detail.push(format!(
                "  pid {} of {} in {}{}",
                p.pid,
                p.user.as_deref().unwrap_or("an unknown user"),
                p.env.as_deref().unwrap_or("no environment"),
                p.memory_bytes
                    .map(|b| format!(", {} MiB", b >> 20))
                    .unwrap_or_default()
            ));
        }
    }
    detail.extend(h.gpus_more());
    for e in &h.envs {
        detail.push(format!("env {}: {}", e.env, e.words()));
    }
    detail.extend(h.envs_more());
    for a in (v.waiting.iter().chain(&v.actions)).filter(|a| a.host == h.host) {
        detail.push(format!("{}: {}", describe(a), a.why.join("; ")));
    }
    detail
}

fn gpu_state(g: &crate::view::GpuView) -> &'static str {
    match g.state {
        GpuState::Free => "free",
        GpuState::InEnv => "in an environment",
        GpuState::Idle if g.processes.is_empty() => "held idle: no job runs on it",
        GpuState::Idle => "idle: its jobs did no work when last sampled",
        GpuState::Stray => "a job outside its environments runs on it",
        GpuState::Violating => "a rule finds against it",
        GpuState::Waiting => "an action waits on it",
    }
}

/// How many actions wait on each user's jobs and environments.
fn waits_by_owner(v: &View) -> std::collections::HashMap<&str, usize> {
    let mut by = std::collections::HashMap::new();
    for u in v.waiting.iter().filter_map(|a| a.owner.as_deref()) {
        *by.entry(u).or_default() += 1;
    }
    by
}

fn user(u: &UserView, waits: usize) -> Shown {
    let count = u.cap_count();
    let over =
        u.device_cap.is_some_and(|c| count > c) || u.memory_cap.is_some_and(|c| u.memory_bytes > c);
    let idle = match u.counted_idle {
        Some(n) if n > 0 => format!(" ({n}i)"),
        _ => String::new(),
    };
    Shown {
        cells: vec![
            u.user.clone(),
            format!(
                "{count}{}{idle}",
                u.device_cap.map(|c| format!("/{c}")).unwrap_or_default()
            ),
            format!(
                "{} MiB{}",
                u.memory_bytes >> 20,
                u.memory_cap
                    .map(|c| format!("/{}", c >> 20))
                    .unwrap_or_default()
            ),
            u.processes.to_string(),
            waits.to_string(),
        ],
        weight: (u64::from(over) << 40) | ((waits as u64) << 32) | u64::from(count),
        tone: if over {
            Style::default().fg(Color::Red)
        } else {
            Style::default()
        },
        at: 0,
    }
}

/// A capped group, after the users: its members' GPUs against its quota.
fn group(g: &GroupView) -> Shown {
    let over = g.devices > g.device_cap;
    Shown {
        cells: vec![
            format!("group {}", g.group),
            format!("{}/{}", g.devices, g.device_cap),
            String::new(),
            String::new(),
            String::new(),
        ],
        weight: (u64::from(over) << 40) | u64::from(g.devices),
        tone: if over {
            Style::default().fg(Color::Red)
        } else {
            Style::default().add_modifier(Modifier::ITALIC)
        },
        at: 0,
    }
}

fn group_detail(g: &GroupView, v: &View) -> Vec<String> {
    let mut detail = vec![format!(
        "group {}: its members' GPUs, {} counted, against its quota of {} (--max-devices-per-group){}",
        g.group,
        g.devices,
        g.device_cap,
        if g.devices > g.device_cap {
            ": over it, the most recent work goes first"
        } else {
            ""
        }
    )];
    for name in &g.users {
        let n = (v.users.iter().find(|u| &u.user == name)).map_or(0, UserView::cap_count);
        detail.push(format!("  {name}: {n} GPU(s)"));
    }
    detail
}

fn user_detail(u: &UserView, v: &View) -> Vec<String> {
    let of = |cap: Option<String>| cap.map(|c| format!(" of {c}")).unwrap_or_default();
    let mut detail = vec![format!(
        "{} runs {} job(s) on {} GPU(s){} with {} MiB{} of GPU memory, over every host",
        u.user,
        u.processes,
        u.devices,
        of(u.device_cap.map(|c| format!("{c} (their cap)"))),
        u.memory_bytes >> 20,
        of(u.memory_cap.map(|c| format!("{} MiB (their cap)", c >> 20)))
    )];
    if let Some(n) = u.counted {
        let idle = u.counted_idle.unwrap_or(0);
        detail.push(format!(
            "their device caps count {n} GPU(s){}, each once: those an environment of theirs is attached to or a job of theirs runs on; {idle} of them held idle (attached, none of their jobs on it)",
            of(u.device_cap.map(|c| c.to_string()))
        ));
    }
    for g in v.groups.iter().filter(|g| g.users.contains(&u.user)) {
        detail.push(format!(
            "member of group {}: {} of its {} GPU(s)",
            g.group, g.devices, g.device_cap
        ));
    }
    for h in &v.hosts {
        for g in &h.gpus {
            for p in g
                .processes
                .iter()
                .filter(|p| p.user.as_deref() == Some(u.user.as_str()))
            {
                detail.push(format!(
                    "  {} gpu {}: pid {} in {}",
                    h.host,
                    g.index,
                    p.pid,
                    p.env.as_deref().unwrap_or("no environment")
                ));
            }
        }
    }
    let waits = (v.waiting.iter()).filter(|a| a.owner.as_deref() == Some(u.user.as_str()));
    for a in waits {
        detail.push(format!("  waits: {}: {}", describe(a), a.why.join("; ")));
    }
    detail
}

/// An action in words: what, on which host, under which rules, why.
fn describe(a: &ActionView) -> String {
    format!(
        "{} on {} ({})",
        a.target.words(),
        a.host,
        a.rules.join(", ")
    )
}

fn due(a: &ActionView, now: u64) -> String {
    if a.warn_only {
        return "warned only".into();
    }
    if let Some(why) = &a.exempt {
        return format!("exempt: {why}");
    }
    match (a.deadline_ms, a.seen) {
        (Some(d), _) if d > now => format!("in {}", span(d - now)),
        (Some(_), _) => "now".into(),
        (None, Some((seen, needed))) => format!("seen {seen}/{needed}"),
        (None, None) => "next cycle".into(),
    }
}

fn waiting_detail(a: &ActionView, now: u64) -> Vec<String> {
    let mut detail = vec![format!("{}: {}", describe(a), due(a, now))];
    detail.extend(a.why.iter().cloned());
    if let Some((seen, needed)) = a.seen {
        detail.push(format!(
            "seen in {seen} cycle(s) of the {needed} it needs (--confirm-cycles)"
        ));
    }
    detail
}

fn waiting(a: &ActionView, now: u64) -> Shown {
    let left = a.deadline_ms.map_or(u64::MAX, |d| d.saturating_sub(now));
    Shown {
        cells: vec![
            a.host.clone(),
            a.target.words(),
            a.rules.join(", "),
            due(a, now),
            a.owner.clone().unwrap_or_default(),
        ],
        weight: u64::MAX - left,
        tone: Style::default().fg(Color::Magenta),
        at: 0,
    }
}

fn done(cycle: u64, a: &ActionView) -> Shown {
    let result = a.result.clone().unwrap_or_default();
    let failed = !matches!(
        result.as_str(),
        "" | "dry run" | "signalled" | "terminated" | "detached" | "gone"
    );
    Shown {
        cells: vec![
            cycle.to_string(),
            a.host.clone(),
            a.target.words(),
            a.rules.join(", "),
            result,
        ],
        weight: (u64::from(failed) << 63) | cycle,
        tone: if failed {
            Style::default().fg(Color::Red)
        } else {
            Style::default()
        },
        at: 0,
    }
}

fn done_detail(cycle: u64, a: &ActionView) -> Vec<String> {
    let result = a.result.as_deref().unwrap_or("");
    let mut detail = vec![format!("cycle {cycle}: {}: {result}", describe(a))];
    detail.extend(a.why.iter().cloned());
    detail
}

/// The help over `area`.
fn help(f: &mut Frame, area: Rect) {
    const KEYS: &[&str] = &[
        "1-4, Tab   fleet, users, waiting, actions",
        "j k, arrows, PgUp PgDn, g   move",
        "Enter      why: the detail of the row",
        "/          filter rows (Enter keeps, Esc clears)",
        "s          sort by name or the most pressing first",
        "q, Esc, Ctrl-C   quit",
        "",
        "GPU marks: . free  e in an environment  i held idle",
        "           S a stray  V violating  W an action waits",
        "",
        "any key closes this",
    ];
    let w = 56.min(area.width);
    let h = (KEYS.len() as u16 + 2).min(area.height);
    let r = Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    );
    f.render_widget(Clear, r);
    let lines: Vec<Line> = KEYS.iter().map(|k| Line::from(*k)).collect();
    f.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(" help ")),
        r,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    fn key(c: KeyCode) -> KeyEvent {
        KeyEvent::new(c, KeyModifiers::NONE)
    }

    /// `top` over the recorded fleet's view, drawn at `now`.
    fn screen(top: &Top, now: u64) -> String {
        let mut t = Terminal::new(TestBackend::new(110, 24)).unwrap();
        t.draw(|f| top.draw(f, now)).unwrap();
        t.backend().to_string()
    }

    fn recorded() -> Top {
        let mut top = Top::new("fixtures".into(), false);
        let mut view = crate::view::tests::recorded_view();
        view.at_ms = Some(1_000_000);
        // One action waits, due in 4 min.
        if let Some(mut a) = view.actions.first().cloned() {
            a.deadline_ms = Some(1_000_000 + 240_000);
            a.result = None;
            view.waiting.push(a);
        }
        top.take(view);
        top
    }

    #[test]
    fn every_tab_of_the_recorded_fleet() {
        let mut top = recorded();
        insta::assert_snapshot!("fleet", screen(&top, 1_010_000));
        for (k, name) in [('2', "users"), ('3', "waiting"), ('4', "actions")] {
            top.key(key(KeyCode::Char(k)));
            insta::assert_snapshot!(name, screen(&top, 1_010_000));
        }
        // The countdown runs with the clock.
        top.key(key(KeyCode::Char('3')));
        assert!(screen(&top, 1_010_000).contains("in 3m50s"));
        assert!(screen(&top, 1_100_000).contains("in 2m20s"));
        assert!(screen(&top, 2_000_000).contains(" now "));
    }

    /// A capped group is a row of the users tab, after the users, red
    /// when over its quota; its detail names its members' counts, and a
    /// member's names the group.
    #[test]
    fn a_capped_group_is_a_row_of_the_users_tab() {
        let mut top = Top::new("fixtures".into(), false);
        let mut view = crate::view::tests::recorded_view();
        let members: Vec<String> = view.users.iter().take(2).map(|u| u.user.clone()).collect();
        let devices = view.users.iter().take(2).map(UserView::cap_count).sum();
        view.groups = vec![GroupView {
            group: "lab".into(),
            devices,
            device_cap: devices - 1,
            users: members.clone(),
        }];
        let n = view.users.len();
        top.take(view);
        top.key(key(KeyCode::Char('2')));
        let s = screen(&top, 0);
        let row = s
            .lines()
            .find(|l| l.contains("group lab"))
            .unwrap_or_default();
        assert!(row.contains(&format!(" {devices}/{} ", devices - 1)), "{s}");
        for _ in 0..n {
            top.key(key(KeyCode::Down));
        }
        top.key(key(KeyCode::Enter));
        let s = screen(&top, 0);
        assert!(s.contains("against its quota of"), "{s}");
        assert!(s.contains("over it, the most"), "{s}");
        assert!(s.contains(&format!("  {}: ", members[0])), "{s}");
        top.key(key(KeyCode::Char('g')));
        let s = screen(&top, 0);
        assert!(
            s.contains("\"member of group lab: 6 of its 5 GPU(s)"),
            "{s}"
        );
        // Most pressing first: the group over its quota leads.
        top.key(key(KeyCode::Esc));
        top.key(key(KeyCode::Char('s')));
        let s = screen(&top, 0);
        let first = s.lines().nth(3).unwrap_or_default();
        assert!(first.contains("group lab"), "{s}");
    }

    #[test]
    fn the_detail_filter_sort_and_help() {
        let mut top = recorded();
        top.key(key(KeyCode::Enter));
        insta::assert_snapshot!("fleet_detail", screen(&top, 1_010_000));
        top.key(key(KeyCode::Esc));
        top.key(key(KeyCode::Char('/')));
        for c in "gpu2".chars() {
            top.key(key(KeyCode::Char(c)));
        }
        top.key(key(KeyCode::Enter));
        let s = screen(&top, 1_010_000);
        assert!(s.contains("1 rows filter /gpu2"), "{s}");
        assert!(!s.contains("gpu1 "), "{s}");
        top.key(key(KeyCode::Esc));
        top.key(key(KeyCode::Char('s')));
        assert!(screen(&top, 1_010_000).contains("by most pressing"));
        top.key(key(KeyCode::Char('?')));
        insta::assert_snapshot!("help", screen(&top, 1_010_000));
        assert!(top.key(key(KeyCode::Char('x'))), "any key closes the help");
        assert!(!top.key(key(KeyCode::Char('q'))));
        assert!(!top.key(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)));
    }

    /// What users write reaches the screen escaped, never as control
    /// characters for the terminal.
    #[test]
    fn what_users_write_is_escaped_on_screen() {
        let mut view = crate::view::tests::recorded_view();
        let evil = "x\u{1b}]0;owned\u{7}";
        view.users[0].user = evil.into();
        view.hosts[0].gpus[0].processes[0].user = Some(evil.into());
        view.hosts[0].host = evil.into();
        let mut top = Top::new(evil.into(), true);
        top.take(view);
        top.key(key(KeyCode::Enter));
        for tab in ['1', '2'] {
            top.key(key(KeyCode::Char(tab)));
            top.key(key(KeyCode::Enter));
            let s = screen(&top, 0);
            assert!(!s.contains('\u{1b}') && !s.contains('\u{7}'), "{s}");
            assert!(s.contains("x\\u{1b}]0;owned"), "{s}");
        }
    }

    /// What the view left out is said on its tab: the users' partial
    /// counts, the waits past 256 a host, and a dry run's actions (a
    /// service's tab shows what it carried out, which holds none).
    #[test]
    fn what_the_view_left_out_is_said_on_its_tab() {
        let mut top = Top::new(String::new(), false);
        let mut view = crate::view::tests::recorded_view();
        (view.counted_left_out, view.waiting_left_out) = (5, 6);
        view.actions_left_out = 7;
        top.take(view.clone());
        let on = |top: &mut Top, tab: char| {
            top.key(key(KeyCode::Char(tab)));
            screen(top, 0)
        };
        assert!(on(&mut top, '2').contains("counts partial: 5 user(s)"));
        assert!(on(&mut top, '3').contains("(and 6 more, over 256 a host)"));
        assert!(on(&mut top, '4').contains("(and 7 more, over 256 a host)"));
        assert!(!on(&mut top, '1').contains("more, over"));
        view.dry_run = false;
        top.take(view);
        assert!(
            !on(&mut top, '4').contains("more, over"),
            "none carried out"
        );
    }

    #[test]
    fn no_view_yet_says_why_and_recent_actions_are_bounded() {
        let mut top = Top::new(
            "no service answers at /run/x.sock: trying again".into(),
            true,
        );
        assert!(screen(&top, 0).contains("no service answers at /run/x.sock"));
        let mut view = crate::view::tests::recorded_view();
        let one = view.actions[0].clone();
        view.actions = vec![one.clone(); 300];
        // A dry run's: what its cycle would do, bounded.
        assert!(view.dry_run);
        top.take(view.clone());
        assert_eq!(top.recent().len(), RECENT);
        // A service that acts: the actions it keeps, with their cycles.
        view.dry_run = false;
        view.cycle = 9;
        view.recent = vec![crate::view::DoneView {
            cycle: 8,
            at_ms: None,
            action: one,
        }];
        top.take(view.clone());
        assert_eq!(top.recent().len(), 1);
        assert_eq!(top.recent()[0].0, 8);
        // Switching to cycles of its own lets the service's view go.
        top.own(true);
        assert!(top.view.is_none() && top.recent().is_empty());
        assert!(screen(&top, 0).contains("no service answers"));
    }
}
