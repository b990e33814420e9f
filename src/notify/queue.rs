//! A channel's queue of messages, one bounded line per recipient, served
//! in turn: no user's events (nor those of owners unknown, which anyone
//! can make) can fill the line another user's warning waits in. Pushing
//! never waits; what a full line cannot take is dropped and counted.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use tokio::sync::Notify;

/// Messages each recipient's line holds before more are dropped.
pub const PER_RECIPIENT: usize = 256;

/// The lines, and which recipients have something waiting, in turn.
#[derive(Debug)]
struct Lines<T> {
    by_recipient: HashMap<String, VecDeque<T>>,
    turn: VecDeque<String>,
    closed: bool,
}

/// One channel's queue, shared by the cycle (pushing) and its worker.
#[derive(Debug)]
pub struct Fair<T> {
    lines: Mutex<Lines<T>>,
    ready: Notify,
    per_recipient: usize,
}

impl<T> Fair<T> {
    /// An empty queue of lines of `per_recipient` messages each.
    pub fn new(per_recipient: usize) -> Self {
        Fair {
            lines: Mutex::new(Lines {
                by_recipient: HashMap::new(),
                turn: VecDeque::new(),
                closed: false,
            }),
            ready: Notify::new(),
            per_recipient,
        }
    }

    /// Queues `item` in `recipient`'s line; false (dropped) when that line
    /// is full or the queue closed. Never waits.
    pub fn push(&self, recipient: &str, item: T) -> bool {
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if lines.closed {
            return false;
        }
        let line = lines.by_recipient.entry(recipient.to_string()).or_default();
        if line.len() >= self.per_recipient {
            return false;
        }
        line.push_back(item);
        if line.len() == 1 {
            lines.turn.push_back(recipient.to_string());
        }
        drop(lines);
        self.ready.notify_one();
        true
    }

    /// How many messages wait, over every line.
    pub fn len(&self) -> usize {
        let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        lines.by_recipient.values().map(VecDeque::len).sum()
    }

    /// Whether no message waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// No more pushes: the worker ends once the lines are empty.
    pub fn close(&self) {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.ready.notify_one();
    }

    /// The next message, the recipients in turn (one each); `None` once
    /// closed and empty.
    pub async fn next(&self) -> Option<T> {
        loop {
            let notified = self.ready.notified();
            if let Some(item) = self.take() {
                return Some(item);
            }
            if self.lines.lock().unwrap_or_else(|e| e.into_inner()).closed {
                return None;
            }
            notified.await;
        }
    }

    fn take(&self) -> Option<T> {
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        let who = lines.turn.pop_front()?;
        let line = lines.by_recipient.get_mut(&who)?;
        let item = line.pop_front();
        if line.is_empty() {
            lines.by_recipient.remove(&who);
        } else {
            lines.turn.push_back(who);
        }
        item
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn recipients_are_served_in_turn_and_a_full_line_drops_only_its_own() {
        let q = Fair::new(3);
        // bob floods his line (and the line of owners unknown).
        let bobs: usize = (0..100).map(|k| usize::from(q.push("bob", k))).sum();
        assert_eq!(bobs, 3);
        assert!(q.push("", 500));
        // alice's warning still gets in, and out second.
        assert!(q.push("alice", 1000));
        let order: Vec<i32> = [q.next().await, q.next().await, q.next().await]
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(order, [0, 500, 1000]);
        q.close();
        assert!(!q.push("alice", 1001), "closed");
        assert_eq!(q.next().await, Some(1));
        assert_eq!(q.next().await, Some(2));
        assert_eq!(q.next().await, None);
    }

    #[tokio::test]
    async fn a_worker_waiting_wakes_for_a_push_and_for_the_close() {
        let q = std::sync::Arc::new(Fair::new(2));
        let worker = {
            let q = std::sync::Arc::clone(&q);
            tokio::spawn(async move {
                let mut got = Vec::new();
                while let Some(x) = q.next().await {
                    got.push(x);
                }
                got
            })
        };
        tokio::task::yield_now().await;
        assert!(q.push("alice", 7));
        tokio::task::yield_now().await;
        q.close();
        assert_eq!(worker.await.unwrap(), [7]);
    }
}
