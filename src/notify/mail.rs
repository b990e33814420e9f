//! Mail through an SMTP server (lettre): to the job's owner, with the
//! admins in copy.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use lettre::message::header::ContentType;
use lettre::message::Mailbox;
use lettre::transport::smtp::authentication::Credentials;
use lettre::{AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor};

use super::message::{self, Medium};
use super::{address_of, Delivery, DeliveryError, NotifyError, UrlError};
use crate::ladder::Event;

/// A whole delivery (connect, TLS, send) takes at most this long.
const DEADLINE: Duration = Duration::from_secs(30);

/// `--smtp` and what goes with it.
#[derive(Clone, PartialEq, Eq)]
pub struct MailSpec {
    /// `smtp://host:port` (plain; `?tls=required` for STARTTLS) or
    /// `smtps://host:port` (implicit TLS).
    pub url: String,
    /// User name and password (`--smtp-credentials`).
    pub credentials: Option<(String, String)>,
    pub from: Mailbox,
    /// `--mail-to`: an address with `{user}` in it.
    pub to: Option<String>,
    /// The inventory's `[users.NAME] email`.
    pub users: BTreeMap<String, String>,
    /// `--mail-admin`: in copy of every message.
    pub admins: Vec<Mailbox>,
}

impl fmt::Debug for MailSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MailSpec")
            .field("url", &self.url)
            .field(
                "credentials",
                &self.credentials.as_ref().map(|(u, _)| (u, "***")),
            )
            .field("from", &self.from)
            .field("to", &self.to)
            .field("users", &self.users)
            .field("admins", &self.admins)
            .finish()
    }
}

/// A mail address from a flag, or why not.
///
/// # Errors
/// Not an address lettre accepts.
pub fn mailbox(flag: &'static str, value: &str) -> Result<Mailbox, NotifyError> {
    value.parse().map_err(|why| NotifyError::Address {
        flag,
        value: value.to_string(),
        why,
    })
}

/// The user name and password in `text` (`--smtp-credentials`): the first
/// line and the second.
///
/// # Errors
/// Fewer than two lines, or an empty name.
pub fn credentials(path: &str, text: &str) -> Result<(String, String), NotifyError> {
    let mut lines = text.lines();
    match (lines.next(), lines.next()) {
        (Some(user), Some(password)) if !user.is_empty() => {
            Ok((user.to_string(), password.to_string()))
        }
        _ => Err(NotifyError::CredentialsText {
            path: path.to_string(),
        }),
    }
}

/// A ready SMTP transport and who gets what.
pub struct Mailer {
    transport: AsyncSmtpTransport<Tokio1Executor>,
    spec: MailSpec,
}

impl Mailer {
    pub fn new(spec: &MailSpec) -> Result<Self, NotifyError> {
        let bad = |url: String, source: UrlError| NotifyError::Smtp { url, source };
        let parsed = reqwest::Url::parse(&spec.url).map_err(|e| bad(spec.url.clone(), e.into()))?;
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(bad(
                format!("{}://{}", parsed.scheme(), parsed.host_str().unwrap_or("")),
                UrlError::Credentials {
                    hint: " (use --smtp-credentials)",
                },
            ));
        }
        let mut builder = AsyncSmtpTransport::<Tokio1Executor>::from_url(&spec.url)
            .map_err(|e| bad(spec.url.clone(), UrlError::Smtp(e)))?
            .timeout(Some(Duration::from_secs(10)));
        if let Some((user, password)) = &spec.credentials {
            builder = builder.credentials(Credentials::new(user.clone(), password.clone()));
        }
        Ok(Mailer {
            transport: builder.build(),
            spec: spec.clone(),
        })
    }

    /// Sends `e` to its owner (if they have an address) and the admins.
    ///
    /// # Errors
    /// The mail could not be made, or the server refused it or did not
    /// answer in time.
    pub async fn deliver(&self, e: &Event, link: Option<&str>) -> Result<Delivery, DeliveryError> {
        let owner = message::recipient(e).and_then(|u| {
            let a = address_of(u, &self.spec.users, self.spec.to.as_deref())?;
            match a.parse::<Mailbox>() {
                Ok(m) => Some(m),
                Err(err) => {
                    tracing::warn!(user = %crate::report::clean(u), error = %err, "no mail address for the user");
                    None
                }
            }
        });
        let mut admins = self.spec.admins.iter().cloned();
        let Some(to) = owner.or_else(|| admins.next()) else {
            return Ok(Delivery::Nobody);
        };
        let said = message::say(e, Medium::Plain, link);
        let mut builder = Message::builder()
            .from(self.spec.from.clone())
            .to(to)
            .subject(said.subject)
            .header(ContentType::TEXT_PLAIN);
        for cc in admins {
            builder = builder.cc(cc);
        }
        let mail = builder.body(said.body).map_err(DeliveryError::Mail)?;
        match tokio::time::timeout(DEADLINE, self.transport.send(mail)).await {
            Ok(Ok(_)) => Ok(Delivery::Sent),
            Ok(Err(e)) => Err(DeliveryError::Smtp(e)),
            Err(_) => Err(DeliveryError::Timeout(DEADLINE)),
        }
    }
}
