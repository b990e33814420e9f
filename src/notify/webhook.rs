//! A webhook: JSON posted with a `text` that Slack and Mattermost show,
//! and the event itself, with bounded retries.

use std::time::Duration;

use serde_json::json;

use super::message::{self, Medium};
use super::{backoff, Delivery, DeliveryError, NotifyError, UrlError};
use crate::ladder::Event;

/// `--webhook` and how hard to try. Its URL is a secret (whoever has it
/// can post to the admins' channel): never printed whole.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSpec {
    pub url: String,
    /// Per attempt.
    pub timeout: Duration,
    /// Attempts in all (a 5xx, a 429 or no answer is tried again).
    pub attempts: u32,
}

impl WebhookSpec {
    /// `url`, each attempt within 10 s, four attempts.
    pub fn new(url: String) -> Self {
        WebhookSpec {
            url,
            timeout: Duration::from_secs(10),
            attempts: 4,
        }
    }
}

impl std::fmt::Debug for WebhookSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookSpec")
            .field("url", &redacted(&self.url))
            .field("timeout", &self.timeout)
            .field("attempts", &self.attempts)
            .finish()
    }
}

/// A URL as it may be printed: its scheme and host, the rest (path,
/// query, credentials: where hooks keep their token) left out.
pub fn redacted(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(u) => format!("{}://{}/...", u.scheme(), u.host_str().unwrap_or("")),
        Err(_) => "(not a URL)".into(),
    }
}

/// A ready HTTP client for one URL.
pub struct Hook {
    client: reqwest::Client,
    url: reqwest::Url,
    attempts: u32,
}

/// `spec`'s URL, if one we post to (http or https, no credentials in it).
///
/// # Errors
/// Why not.
pub fn url(spec: &WebhookSpec) -> Result<reqwest::Url, NotifyError> {
    let bad = |source: UrlError| NotifyError::Webhook {
        url: redacted(&spec.url),
        source,
    };
    let url = reqwest::Url::parse(&spec.url).map_err(|e| bad(e.into()))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad(UrlError::Credentials { hint: "" }));
    }
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad(UrlError::Scheme));
    }
    Ok(url)
}

impl Hook {
    pub fn new(spec: &WebhookSpec) -> Result<Self, NotifyError> {
        let url = url(spec)?;
        let client = reqwest::Client::builder()
            .timeout(spec.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| NotifyError::Webhook {
                url: redacted(&spec.url),
                source: UrlError::Client(e.without_url()),
            })?;
        Ok(Hook {
            client,
            url,
            attempts: spec.attempts.max(1),
        })
    }

    /// Posts `e`, trying again after a failure that may pass.
    ///
    /// # Errors
    /// A client error (4xx but 429) at once, or every attempt failed.
    pub async fn deliver(&self, e: &Event, link: Option<&str>) -> Result<Delivery, DeliveryError> {
        let said = message::say(e, Medium::Chat, link);
        let body = json!({
            "text": format!("{}\n{}", said.subject, said.body.trim_end()),
            "event": e,
        });
        let mut last = None;
        let mut asked = None;
        for attempt in 1..=self.attempts {
            if attempt > 1 {
                tokio::time::sleep(wait_before(attempt - 1, asked.take())).await;
            }
            match self.client.post(self.url.clone()).json(&body).send().await {
                Ok(r) if r.status().is_success() => return Ok(Delivery::Sent),
                Ok(r) => {
                    let status = r.status();
                    asked = r
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok());
                    if status.is_client_error() && status != reqwest::StatusCode::TOO_MANY_REQUESTS
                    {
                        return Err(DeliveryError::Status(status));
                    }
                    last = Some(DeliveryError::Status(status));
                }
                // Without the URL: it is a secret.
                Err(err) => last = Some(DeliveryError::Http(err.without_url())),
            }
        }
        Err(DeliveryError::GaveUp {
            attempts: self.attempts,
            last: Box::new(last.unwrap_or(DeliveryError::Timeout(std::time::Duration::ZERO))),
        })
    }
}

/// The wait before retry `attempt` (1-based): the backoff, or longer when
/// the receiver asked for it (`Retry-After`, in seconds), up to 30 s.
fn wait_before(attempt: u32, retry_after: Option<u64>) -> Duration {
    let asked = Duration::from_secs(retry_after.unwrap_or(0).min(30));
    backoff(attempt).max(asked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_waits_as_long_as_the_receiver_asks_up_to_thirty_seconds() {
        assert_eq!(wait_before(1, None), Duration::from_secs(1));
        assert_eq!(wait_before(2, Some(0)), Duration::from_secs(2));
        assert_eq!(wait_before(1, Some(7)), Duration::from_secs(7));
        assert_eq!(wait_before(3, Some(3)), Duration::from_secs(4));
        assert_eq!(wait_before(1, Some(3600)), Duration::from_secs(30));
    }

    #[test]
    fn the_url_is_never_printed_past_its_host() {
        let spec = WebhookSpec {
            url: "https://hooks.example/services/T0/B0/s3cr3t?x=1".into(),
            timeout: Duration::from_secs(10),
            attempts: 4,
        };
        let shown = format!("{spec:?}");
        assert!(shown.contains("\"https://hooks.example/...\""), "{shown}");
        assert!(
            !shown.contains("s3cr3t") && shown.contains("attempts: 4"),
            "{shown}"
        );
        assert_eq!(redacted("not a url"), "(not a URL)");
    }
}
