//! What Redis keeps through a crash, read from its own settings at start.
//!
//! | `appendonly` | `appendfsync` | class | lost when Redis crashes (or its machine does) |
//! |---|---|---|---|
//! | yes | always | `crash_durable` | nothing acknowledged: each write is fsynced before Redis answers |
//! | yes | everysec | `aof_everysec` | about the last second of acknowledged writes |
//! | yes | no | `aof_no` | whatever the OS had not yet written back (often tens of seconds) |
//! | no | — | `no_aof` | everything since the last snapshot, or everything; the token counter can go back |
//!
//! A Redis whose `CONFIG` command is refused (managed services rename it) is `unknown` and
//! treated as not crash-durable.

use ::redis::aio::ConnectionManager;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durability {
    pub appendonly: Option<String>,
    pub appendfsync: Option<String>,
}

impl Durability {
    /// Reads `appendonly` and `appendfsync`. A connection failure is an error; a refused
    /// `CONFIG GET` is not (the settings are then unknown).
    pub async fn read(conn: &mut ConnectionManager) -> ::redis::RedisResult<Durability> {
        let mut get = async |name: &str| -> ::redis::RedisResult<Option<String>> {
            let r: ::redis::RedisResult<Vec<String>> = ::redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query_async(conn)
                .await;
            match r {
                Ok(pair) => Ok(pair.get(1).map(|v| v.to_ascii_lowercase())),
                Err(e)
                    if e.kind()
                        == ::redis::ErrorKind::Server(::redis::ServerErrorKind::ResponseError) =>
                {
                    Ok(None)
                }
                Err(e) if e.code().is_some() => Ok(None),
                Err(e) => Err(e),
            }
        };
        let appendonly = get("appendonly").await?;
        let appendfsync = get("appendfsync").await?;
        Ok(Durability {
            appendonly,
            appendfsync,
        })
    }

    pub fn append_only(&self) -> bool {
        self.appendonly.as_deref() == Some("yes")
    }

    pub fn crash_durable(&self) -> bool {
        self.class() == "crash_durable"
    }

    /// The class exported as the `backend_durability` metric.
    pub fn class(&self) -> &'static str {
        match (self.appendonly.as_deref(), self.appendfsync.as_deref()) {
            (Some("yes"), Some("always")) => "crash_durable",
            (Some("yes"), Some("everysec")) => "aof_everysec",
            (Some("yes"), Some("no")) => "aof_no",
            (Some("no"), _) => "no_aof",
            _ => "unknown",
        }
    }

    /// The settings found, in words, for the refusal and the warning.
    pub fn describe(&self) -> String {
        let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "unknown".into());
        format!(
            "appendonly is {}, appendfsync is {}",
            show(&self.appendonly),
            show(&self.appendfsync)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::Durability;

    fn d(a: Option<&str>, f: Option<&str>) -> Durability {
        Durability {
            appendonly: a.map(String::from),
            appendfsync: f.map(String::from),
        }
    }

    #[test]
    fn only_append_only_with_fsync_always_is_crash_durable() {
        assert_eq!(d(Some("yes"), Some("always")).class(), "crash_durable");
        assert!(d(Some("yes"), Some("always")).crash_durable());
        assert_eq!(d(Some("yes"), Some("everysec")).class(), "aof_everysec");
        assert_eq!(d(Some("yes"), Some("no")).class(), "aof_no");
        assert_eq!(d(Some("no"), Some("always")).class(), "no_aof");
        assert_eq!(d(None, None).class(), "unknown");
        assert!(!d(None, None).crash_durable());
        assert_eq!(
            d(Some("no"), Some("everysec")).describe(),
            "appendonly is no, appendfsync is everysec"
        );
    }
}
