//! A webhook: JSON posted with a `text` that Slack and Mattermost show,
//! and the event itself, with bounded retries.

use std::time::Duration;

use serde_json::json;

use super::message::{self, Medium};
use super::{backoff, Delivery, NotifyError};
use crate::ladder::Event;

/// `--webhook` and how hard to try.
#[derive(Debug, Clone)]
pub struct WebhookSpec {
    pub url: String,
    /// Per attempt.
    pub timeout: Duration,
    /// Attempts in all (a 5xx, a 429 or no answer is tried again).
    pub attempts: u32,
}

/// A ready HTTP client for one URL.
pub struct Hook {
    client: reqwest::Client,
    url: reqwest::Url,
    attempts: u32,
}

impl Hook {
    pub fn new(spec: &WebhookSpec) -> Result<Self, NotifyError> {
        let bad = |why: String| NotifyError::Webhook {
            url: spec.url.clone(),
            why,
        };
        let url = reqwest::Url::parse(&spec.url).map_err(|e| bad(e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad("not an http:// or https:// URL".into()));
        }
        let client = reqwest::Client::builder()
            .timeout(spec.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| bad(crate::error::chain(&e)))?;
        Ok(Hook {
            client,
            url,
            attempts: spec.attempts.max(1),
        })
    }

    /// Posts `e`, trying again after a failure that may pass.
    pub async fn deliver(&self, e: &Event) -> Result<Delivery, String> {
        let said = message::say(e, Medium::Chat);
        let body = json!({
            "text": format!("{}\n{}", said.subject, said.body.trim_end()),
            "event": e,
        });
        let mut last = String::new();
        for attempt in 1..=self.attempts {
            if attempt > 1 {
                tokio::time::sleep(backoff(attempt - 1)).await;
            }
            match self.client.post(self.url.clone()).json(&body).send().await {
                Ok(r) if r.status().is_success() => return Ok(Delivery::Sent),
                Ok(r) => {
                    let status = r.status();
                    last = format!("HTTP {status}");
                    if status.is_client_error() && status != reqwest::StatusCode::TOO_MANY_REQUESTS
                    {
                        return Err(last);
                    }
                }
                Err(err) => last = crate::error::chain(&err),
            }
        }
        Err(format!("{last} (after {} attempts)", self.attempts))
    }
}
