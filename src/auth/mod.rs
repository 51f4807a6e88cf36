//! API tokens: who may call, with which role, on which key, pool and queue prefixes.
//!
//! A token is a 256-bit secret from the OS RNG, shown once when it is created. The tokens
//! file keeps only its SHA-256 (a secret of that strength needs no slow hash: there is
//! nothing to guess from), with a name, a role and optional scopes. The server loads the
//! file at start and again on SIGHUP; a request's token is looked up by the hash of what it
//! presents, one hash and one map probe.
//!
//! Sessions belong to the token that opened them. The binding travels in the session id
//! itself: the second half of the id is a digest of the first half under the opening
//! token's hash, so the server tells whose a session is without storing anything, on every
//! backend and after a restart, and a session of another token answers 404 like one that
//! does not exist.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::domain::SessionId;

/// What a token may do. Each role may do everything the ones before it may.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// List and inspect: sessions, locks, fences, pools, queues, jobs, events, metrics.
    Reader,
    /// A reader that also opens sessions and acts through the sessions it opened: locks,
    /// seats, enqueue, claim and finish jobs.
    Client,
    /// A client that also force-ends sessions, reaps, requeues and creates, resizes or
    /// deletes pools.
    Operator,
    /// Everything, including the token floor and backups.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Client => "client",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

/// One token as the tokens file stores it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    /// Unique; named in audit events and logs (the secret never is).
    pub name: String,
    pub role: Role,
    /// `sha256:` and 64 lowercase hex digits: the SHA-256 of the secret.
    pub hash: String,
    /// Lock-key prefixes the token may touch; absent means every key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<Vec<String>>,
    /// Pool-name prefixes; absent means every pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<Vec<String>>,
    /// Queue-name prefixes; absent means every queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<Vec<String>>,
    /// A DNS name in the subjectAltName of a client certificate (verified against
    /// `tls_client_ca`) that acts as this token without a bearer header. Compared without
    /// regard to case; no wildcards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_subject: Option<String>,
    /// Unix milliseconds.
    #[serde(default)]
    pub created_at: u64,
}

/// The tokens file: `[[token]]` tables.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokensFile {
    #[serde(default)]
    pub token: Vec<TokenEntry>,
}

#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("cannot read tokens file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write tokens file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tokens file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

pub type Hash = [u8; 32];

const SECRET_PREFIX: &str = "lh_";

/// A new secret: `lh_` and 64 hex digits of OS randomness (256 bits).
pub fn new_secret() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the OS random number generator is available");
    let mut s = String::with_capacity(SECRET_PREFIX.len() + 64);
    s.push_str(SECRET_PREFIX);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

pub fn hash(secret: &str) -> Hash {
    Sha256::digest(secret.as_bytes()).into()
}

/// The file form of a hash.
pub fn hash_text(h: &Hash) -> String {
    let mut s = String::from("sha256:");
    for b in h {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn parse_hash(text: &str) -> Option<Hash> {
    let hex = text.strip_prefix("sha256:")?;
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl TokensFile {
    pub fn read(path: &Path) -> Result<TokensFile, TokensError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokensError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let file: TokensFile = toml::from_str(&text).map_err(|e| TokensError::Invalid {
            path: path.to_path_buf(),
            message: e.message().to_string(),
        })?;
        file.validate().map_err(|message| TokensError::Invalid {
            path: path.to_path_buf(),
            message,
        })?;
        Ok(file)
    }

    /// Reads the file, or an empty set when it does not exist yet (`tokens create`).
    pub fn read_or_empty(path: &Path) -> Result<TokensFile, TokensError> {
        if path.exists() {
            TokensFile::read(path)
        } else {
            Ok(TokensFile::default())
        }
    }

    /// Writes through a temporary file and a rename, so a server reloading at the same
    /// moment reads the old file or the new one, never half of one. The file is made
    /// readable by its owner only.
    pub fn write(&self, path: &Path) -> Result<(), TokensError> {
        let err = |source| TokensError::Write {
            path: path.to_path_buf(),
            source,
        };
        let text = toml::to_string(self).expect("a tokens file always serializes");
        let tmp = path.with_extension("tmp");
        {
            use std::io::Write;
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create(true).truncate(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
            let mut f = opts.open(&tmp).map_err(err)?;
            f.write_all(text.as_bytes()).map_err(err)?;
            f.sync_all().map_err(err)?;
        }
        std::fs::rename(&tmp, path).map_err(err)
    }

    pub fn validate(&self) -> Result<(), String> {
        let mut names = std::collections::HashSet::new();
        let mut hashes = std::collections::HashSet::new();
        let mut subjects = std::collections::HashSet::new();
        for t in &self.token {
            if let Some(subject) = &t.cert_subject {
                if !valid_cert_subject(subject) {
                    return Err(format!(
                        "token {:?}: cert_subject {subject:?} must be a DNS name (labels of a-z, 0-9 and '-', joined by '.', at most 253 characters; no wildcard)",
                        t.name
                    ));
                }
                if !subjects.insert(subject.to_ascii_lowercase()) {
                    return Err(format!(
                        "token {:?}: cert_subject {subject:?} is another token's too",
                        t.name
                    ));
                }
            }
            if !valid_name(&t.name) {
                return Err(format!(
                    "token name {:?} must be 1 to 64 characters of a-z, A-Z, 0-9, '-', '_' and '.'",
                    t.name
                ));
            }
            if !names.insert(t.name.as_str()) {
                return Err(format!("token name {:?} appears twice", t.name));
            }
            let Some(h) = parse_hash(&t.hash) else {
                return Err(format!(
                    "token {:?}: hash must be sha256: and 64 hex digits",
                    t.name
                ));
            };
            if !hashes.insert(h) {
                return Err(format!("token {:?}: its hash appears twice", t.name));
            }
            for (kind, list) in [
                ("keys", &t.keys),
                ("pools", &t.pools),
                ("queues", &t.queues),
            ] {
                if let Some(list) = list
                    && list.iter().any(|p| p.len() > 512)
                {
                    return Err(format!(
                        "token {:?}: a {kind} prefix is longer than 512 bytes",
                        t.name
                    ));
                }
            }
        }
        Ok(())
    }
}

pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A DNS name as a certificate's subjectAltName carries it: 1 to 253 characters, labels
/// of 1 to 63 letters, digits and inner hyphens. Wildcards are refused: one token stands
/// for one named client.
pub fn valid_cert_subject(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

/// Per-token request rate: a token bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Requests a second, sustained.
    pub per_s: f64,
    /// Requests allowed at once above the sustained rate.
    pub burst: f64,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// One loaded token.
pub struct Token {
    pub name: String,
    pub role: Role,
    pub keys: Option<Vec<String>>,
    pub pools: Option<Vec<String>>,
    pub queues: Option<Vec<String>>,
    pub hash: Hash,
    /// Kept across reloads for a token whose hash stays, so a reload resets no limit.
    bucket: Arc<Mutex<Bucket>>,
    /// Requests of this token waiting now (for a lock, a seat or a job).
    pub waiting: Arc<AtomicU32>,
}

/// The kind of name a scope restricts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Key,
    Pool,
    Queue,
}

impl Token {
    pub fn unscoped(&self) -> bool {
        self.keys.is_none() && self.pools.is_none() && self.queues.is_none()
    }

    fn prefixes(&self, scope: Scope) -> Option<&[String]> {
        match scope {
            Scope::Key => self.keys.as_deref(),
            Scope::Pool => self.pools.as_deref(),
            Scope::Queue => self.queues.as_deref(),
        }
    }

    /// Whether `name` falls under one of the token's prefixes for `scope`. For a list
    /// filter this is also the rule: every name starting with an allowed prefix is allowed.
    pub fn allows(&self, scope: Scope, name: &str) -> bool {
        match self.prefixes(scope) {
            None => true,
            Some(list) => list.iter().any(|p| name.starts_with(p.as_str())),
        }
    }

    /// Takes one request from the bucket; `Err(seconds)` says when the next is allowed.
    pub fn take(&self, limit: RateLimit) -> Result<(), u64> {
        let mut b = self.bucket.lock();
        let now = Instant::now();
        let refill = now.duration_since(b.at).as_secs_f64() * limit.per_s;
        b.tokens = (b.tokens + refill).min(limit.burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            let wait = (1.0 - b.tokens) / limit.per_s;
            Err(wait.ceil().max(1.0) as u64)
        }
    }

    /// A fresh session id bound to this token: 60 random bits, then a digest of them under
    /// the token's hash. Both halves keep the UUID version 4 and variant bits.
    pub fn mint(&self) -> SessionId {
        let mut head = [0u8; 8];
        getrandom::fill(&mut head).expect("the OS random number generator is available");
        head[6] = (head[6] & 0x0f) | 0x40;
        SessionId::from_u128(self.bind(head))
    }

    fn bind(&self, head: [u8; 8]) -> u128 {
        let mut h = Sha256::new();
        h.update(b"leasehold session binding\0");
        h.update(self.hash);
        h.update(head);
        let d = h.finalize();
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&head);
        id[8..].copy_from_slice(&d[..8]);
        id[8] = (id[8] & 0x3f) | 0x80;
        u128::from_be_bytes(id)
    }

    /// Whether this token opened `id`.
    pub fn opened(&self, id: SessionId) -> bool {
        let bytes = id.as_u128().to_be_bytes();
        let mut head = [0u8; 8];
        head.copy_from_slice(&bytes[..8]);
        self.bind(head) == id.as_u128()
    }
}

/// The loaded tokens, by hash and by the certificate name they stand for.
#[derive(Default)]
pub struct TokenSet {
    by_hash: HashMap<Hash, Arc<Token>>,
    /// Lowercased `cert_subject`s.
    by_cert: HashMap<String, Arc<Token>>,
}

impl TokenSet {
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    fn build(file: &TokensFile, old: &TokenSet, burst: f64) -> TokenSet {
        let mut by_hash = HashMap::with_capacity(file.token.len());
        let mut by_cert = HashMap::new();
        for e in &file.token {
            let hash = parse_hash(&e.hash).expect("validated");
            let (bucket, waiting) = match old.by_hash.get(&hash) {
                Some(t) => (t.bucket.clone(), t.waiting.clone()),
                None => (
                    Arc::new(Mutex::new(Bucket {
                        tokens: burst,
                        at: Instant::now(),
                    })),
                    Arc::new(AtomicU32::new(0)),
                ),
            };
            let token = Arc::new(Token {
                name: e.name.clone(),
                role: e.role,
                keys: e.keys.clone(),
                pools: e.pools.clone(),
                queues: e.queues.clone(),
                hash,
                bucket,
                waiting,
            });
            if let Some(subject) = &e.cert_subject {
                by_cert.insert(subject.to_ascii_lowercase(), token.clone());
            }
            by_hash.insert(hash, token);
        }
        TokenSet { by_hash, by_cert }
    }
}

/// What a client certificate's names map to.
pub enum CertMatch {
    /// No token names it: the certificate carries no identity.
    None,
    One(Arc<Token>),
    /// Its names map to two different tokens: it names no one caller, and acts as none.
    Ambiguous,
}

/// The tokens the server accepts, reloadable from their file.
pub struct Auth {
    path: PathBuf,
    set: RwLock<Arc<TokenSet>>,
    pub rate: RateLimit,
}

impl Auth {
    pub fn load(path: &Path, rate: RateLimit) -> Result<Auth, TokensError> {
        let file = TokensFile::read(path)?;
        Ok(Auth {
            path: path.to_path_buf(),
            set: RwLock::new(Arc::new(TokenSet::build(
                &file,
                &TokenSet::default(),
                rate.burst,
            ))),
            rate,
        })
    }

    /// Reads the file again. A file that does not parse changes nothing: the tokens in
    /// force stay, and the error is for the log.
    pub fn reload(&self) -> Result<usize, TokensError> {
        let file = TokensFile::read(&self.path)?;
        let old = self.set.read().clone();
        let set = Arc::new(TokenSet::build(&file, &old, self.rate.burst));
        let n = set.len();
        *self.set.write() = set;
        Ok(n)
    }

    pub fn len(&self) -> usize {
        self.set.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token whose secret is `secret`.
    pub fn lookup(&self, secret: &str) -> Option<Arc<Token>> {
        let h = hash(secret);
        self.set.read().by_hash.get(&h).cloned()
    }

    /// The token a verified client certificate with these (lowercased) DNS names stands
    /// for.
    pub fn lookup_cert(&self, names: &[String]) -> CertMatch {
        let set = self.set.read();
        let mut found: Option<&Arc<Token>> = None;
        for n in names {
            if let Some(t) = set.by_cert.get(n) {
                match found {
                    Some(f) if f.hash != t.hash => return CertMatch::Ambiguous,
                    _ => found = Some(t),
                }
            }
        }
        found.map_or(CertMatch::None, |t| CertMatch::One(t.clone()))
    }
}

/// Counts a waiting request of a token until dropped.
pub struct WaitSlot(Arc<AtomicU32>);

impl WaitSlot {
    /// A slot, unless `max` requests of the token already wait.
    pub fn take(counter: &Arc<AtomicU32>, max: u32) -> Option<WaitSlot> {
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| WaitSlot(counter.clone()))
    }
}

impl Drop for WaitSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(keys: Option<Vec<String>>) -> Token {
        Token {
            name: "t".into(),
            role: Role::Client,
            keys,
            pools: None,
            queues: None,
            hash: hash(&new_secret()),
            bucket: Arc::new(Mutex::new(Bucket {
                tokens: 2.0,
                at: Instant::now(),
            })),
            waiting: Arc::new(AtomicU32::new(0)),
        }
    }

    #[test]
    fn secrets_are_256_bits_and_hash_round_trips() {
        let s = new_secret();
        assert_eq!(s.len(), 3 + 64);
        assert_ne!(s, new_secret());
        let h = hash(&s);
        assert_eq!(parse_hash(&hash_text(&h)), Some(h));
        assert_eq!(parse_hash("sha256:00"), None);
        assert_eq!(parse_hash(&hash_text(&h).replace("sha256:", "md5:")), None);
    }

    #[test]
    fn a_minted_session_belongs_to_its_token_only() {
        let (a, b) = (token(None), token(None));
        let id = a.mint();
        assert!(a.opened(id));
        assert!(!b.opened(id));
        assert!(!a.opened(SessionId::random()));
        assert_eq!(id.0.get_version_num(), 4);
        assert_eq!(id.0.get_variant(), uuid::Variant::RFC4122);
    }

    #[test]
    fn scopes_are_prefixes() {
        let t = token(Some(vec!["team-a/".into()]));
        assert!(t.allows(Scope::Key, "team-a/db"));
        assert!(!t.allows(Scope::Key, "team-b/db"));
        assert!(!t.allows(Scope::Key, "team-a"));
        assert!(t.allows(Scope::Pool, "anything"));
        assert!(!t.unscoped());
    }

    #[test]
    fn the_bucket_refuses_past_its_burst() {
        let t = token(None);
        let limit = RateLimit {
            per_s: 0.001,
            burst: 2.0,
        };
        assert!(t.take(limit).is_ok());
        assert!(t.take(limit).is_ok());
        let retry = t.take(limit).unwrap_err();
        assert!(retry >= 1, "{retry}");
    }

    #[test]
    fn wait_slots_are_bounded_and_given_back() {
        let c = Arc::new(AtomicU32::new(0));
        let a = WaitSlot::take(&c, 1).unwrap();
        assert!(WaitSlot::take(&c, 1).is_none());
        drop(a);
        assert!(WaitSlot::take(&c, 1).is_some());
    }

    #[test]
    fn the_file_is_validated() {
        let h = hash_text(&hash("x"));
        let entry = |name: &str, hash: &str| TokenEntry {
            name: name.into(),
            role: Role::Reader,
            hash: hash.into(),
            keys: None,
            pools: None,
            queues: None,
            cert_subject: None,
            created_at: 0,
        };
        let ok = TokensFile {
            token: vec![entry("a", &h)],
        };
        ok.validate().unwrap();
        let twice = TokensFile {
            token: vec![entry("a", &h), entry("a", &hash_text(&hash("y")))],
        };
        assert!(twice.validate().unwrap_err().contains("twice"));
        let bad = TokensFile {
            token: vec![entry("a b", &h)],
        };
        assert!(bad.validate().is_err());
        let bad_hash = TokensFile {
            token: vec![entry("a", "sha256:zz")],
        };
        assert!(bad_hash.validate().is_err());
    }
}
