//! A per-user rate limit: at most so many messages to one user over a
//! sliding hour, so that a user whose jobs keep breaking a rule is not
//! flooded (nor the mail server). Pure: time comes in.

use std::collections::{HashMap, VecDeque};

const HOUR_MS: u64 = 3_600_000;

/// Messages sent to each user over the last hour.
#[derive(Debug, Clone)]
pub struct RateLimit {
    per_hour: u32,
    sent: HashMap<String, VecDeque<u64>>,
}

impl RateLimit {
    /// At most `per_hour` messages per user in any hour (0: none).
    pub fn new(per_hour: u32) -> Self {
        RateLimit {
            per_hour,
            sent: HashMap::new(),
        }
    }

    /// Whether a message to `user` may go at `now_ms`; if so it is
    /// counted. Users seen no more within the hour are forgotten, so the
    /// table holds only the last hour's users.
    pub fn allow(&mut self, user: &str, now_ms: u64) -> bool {
        self.sent.retain(|_, times| {
            while times
                .front()
                .is_some_and(|t| now_ms.saturating_sub(*t) >= HOUR_MS)
            {
                times.pop_front();
            }
            !times.is_empty()
        });
        let times = self.sent.entry(user.to_string()).or_default();
        if times.len() >= self.per_hour as usize {
            if times.is_empty() {
                self.sent.remove(user);
            }
            return false;
        }
        times.push_back(now_ms);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_user_gets_at_most_n_an_hour() {
        let mut l = RateLimit::new(2);
        assert!(l.allow("alice", 0));
        assert!(l.allow("alice", 1_000));
        assert!(!l.allow("alice", 2_000));
        // Another user has their own count.
        assert!(l.allow("bob", 2_000));
        // An hour after the first, one more may go.
        assert!(!l.allow("alice", HOUR_MS - 1));
        // Exactly an hour after the first: it no longer counts.
        let mut edge = RateLimit::new(1);
        assert!(edge.allow("alice", 5));
        assert!(!edge.allow("alice", HOUR_MS + 4));
        assert!(edge.allow("alice", HOUR_MS + 5));
        assert!(l.allow("alice", HOUR_MS + 1));
        assert!(!l.allow("alice", HOUR_MS + 2));
        assert!(l.allow("alice", HOUR_MS + 1_001));
    }

    #[test]
    fn users_gone_quiet_are_forgotten_and_zero_sends_nothing() {
        let mut l = RateLimit::new(1);
        assert!(l.allow("alice", 0));
        assert!(l.allow("bob", HOUR_MS + 1));
        assert_eq!(l.sent.len(), 1);
        let mut none = RateLimit::new(0);
        assert!(!none.allow("alice", 0));
        assert!(none.sent.is_empty());
    }
}
