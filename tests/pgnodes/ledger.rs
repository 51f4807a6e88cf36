//! Load against nodes that are killed, or lose their database, mid-request: a ledger of what
//! the clients were told, the requests whose outcome they never learnt ("in doubt"), and the
//! check of a node's view against it.
//!
//! A request in doubt may take effect late — a killed node's database connection can still
//! commit the statement it was running — so a doubt is resolved only by what the database
//! shows once the load has stopped, and it may resolve either way; nothing else may differ.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::Method;
use leasehold::client::{Client, Reply, segment};
use serde_json::{Value, json};

use super::{Node, Outcome, Rng, send};

pub fn key_name(k: usize) -> String {
    format!("load/{k}")
}

#[derive(Debug, Clone, PartialEq)]
pub enum Doubt {
    /// `floor`: the highest token acknowledged when the request was sent.
    Acquire {
        key: usize,
        session: String,
        floor: u64,
    },
    Release {
        key: usize,
        token: u64,
    },
    Close {
        session: String,
    },
}

#[derive(Default, Debug)]
pub struct Stats {
    pub acquired: u64,
    pub busy: u64,
    pub released: u64,
    pub heartbeats: u64,
    pub opened: u64,
    pub closed: u64,
    pub in_doubt: u64,
    pub doubts_that_committed: u64,
    pub unavailable: u64,
    pub not_sent: u64,
}

pub struct Ledger {
    pub keys: usize,
    /// Per key: grants acknowledged and not acknowledged as ended, token → session.
    pub live: Vec<BTreeMap<u64, String>>,
    /// Every token seen, acknowledged or found.
    pub seen: HashSet<u64>,
    pub last_per_key: Vec<u64>,
    /// The highest token acknowledged or found so far.
    pub max_token: u64,
    /// Sessions acknowledged open and not known to be closed.
    pub open: BTreeSet<String>,
    /// Sessions acknowledged closed.
    pub closed: BTreeSet<String>,
    /// Requests whose outcome is not known: in flight (releases and closes are entered
    /// before they are sent), or never answered.
    pub doubts: Vec<Doubt>,
    /// Grants taken over by a later grant of their key while their release (or their
    /// session's close) was in flight: token → (key, session).
    pub superseded: HashMap<u64, (usize, String)>,
    pub violations: Vec<String>,
    pub stats: Stats,
}

impl Ledger {
    pub fn new(keys: usize) -> Ledger {
        Ledger {
            keys,
            live: vec![BTreeMap::new(); keys],
            seen: HashSet::new(),
            last_per_key: vec![0; keys],
            max_token: 0,
            open: BTreeSet::new(),
            closed: BTreeSet::new(),
            doubts: Vec::new(),
            superseded: HashMap::new(),
            violations: Vec::new(),
            stats: Stats::default(),
        }
    }

    pub fn violation(&mut self, v: String) {
        self.violations.push(v);
    }

    pub fn holdings(&self, session: &str) -> BTreeMap<usize, u64> {
        let mut out = BTreeMap::new();
        for (k, grants) in self.live.iter().enumerate() {
            for (t, s) in grants {
                if s == session {
                    out.insert(k, *t);
                }
            }
        }
        out
    }

    fn release_in_doubt(&self, key: usize, token: u64, session: &str) -> bool {
        self.doubts.iter().any(|d| match d {
            Doubt::Release { key: k, token: t } => *k == key && *t == token,
            Doubt::Close { session: s } => s == session,
            Doubt::Acquire { .. } => false,
        })
    }

    /// A token the ledger has not seen: above everything acknowledged before its request was
    /// sent, and above every earlier grant of its key.
    fn fresh_token(&mut self, key: usize, token: u64, floor: u64, what: &str) {
        if self.seen.contains(&token) {
            self.violation(format!(
                "{what}: token {token} for {} was issued before (a token was reused)",
                key_name(key)
            ));
        }
        if token <= floor {
            self.violation(format!(
                "{what}: token {token} for {} is not above {floor}, a token acknowledged \
                 before the request was sent (a token went backwards)",
                key_name(key)
            ));
        }
        if token <= self.last_per_key[key] {
            self.violation(format!(
                "{what}: token {token} for {} is not above {}, an earlier grant of that key",
                key_name(key),
                self.last_per_key[key]
            ));
        }
        self.seen.insert(token);
        self.last_per_key[key] = self.last_per_key[key].max(token);
        self.max_token = self.max_token.max(token);
    }

    /// A new grant of `key`: every grant the ledger has for the key must be one whose end is
    /// in doubt (and then it ended), or two sessions hold the key.
    fn take_key(&mut self, key: usize, session: &str, token: u64, what: &str) {
        let earlier: Vec<(u64, String)> = self.live[key]
            .iter()
            .map(|(t, s)| (*t, s.clone()))
            .collect();
        for (t, s) in earlier {
            if !self.release_in_doubt(key, t, &s) {
                self.violation(format!(
                    "{what}: {} granted to {session} with token {token} while {s} holds it \
                     with token {t}, acknowledged and never released",
                    key_name(key)
                ));
            }
            self.live[key].remove(&t);
            self.superseded.insert(t, (key, s));
        }
        self.live[key].insert(token, session.to_string());
    }

    fn settle(&mut self, d: &Doubt) {
        if let Some(i) = self.doubts.iter().position(|x| x == d) {
            self.doubts.remove(i);
        }
    }

    pub fn ack_acquire(&mut self, key: usize, session: &str, token: u64, floor: u64) {
        self.fresh_token(key, token, floor, "acquire");
        self.take_key(key, session, token, "acquire");
        self.stats.acquired += 1;
    }

    pub fn ack_release(&mut self, key: usize, session: &str, token: u64) {
        self.settle(&Doubt::Release { key, token });
        let found = self.live[key]
            .remove(&token)
            .or_else(|| self.superseded.remove(&token).map(|(_, s)| s));
        match found {
            Some(s) if s == session => {}
            other => self.violation(format!(
                "release of {} token {token} by {session} was acknowledged, but the ledger had \
                 that grant as {other:?}",
                key_name(key)
            )),
        }
        self.stats.released += 1;
    }

    pub fn ack_open(&mut self, session: &str) {
        self.open.insert(session.to_string());
        self.stats.opened += 1;
    }

    pub fn ack_close(&mut self, session: &str, released: u64) {
        self.settle(&Doubt::Close {
            session: session.to_string(),
        });
        let mut held = self.holdings(session);
        for (t, (k, s)) in &self.superseded {
            if s == session {
                held.insert(*k, *t);
            }
        }
        if held.len() as u64 != released {
            self.violation(format!(
                "closing {session} released {released} locks, but it held {held:?}"
            ));
        }
        for (k, t) in held {
            self.live[k].remove(&t);
            self.superseded.remove(&t);
        }
        self.open.remove(session);
        self.closed.insert(session.to_string());
        self.stats.closed += 1;
    }

    fn drop_session(&mut self, session: &str) {
        for k in 0..self.keys {
            self.live[k].retain(|_, s| s != session);
        }
        self.superseded.retain(|_, (_, s)| s != session);
        self.open.remove(session);
        self.closed.insert(session.to_string());
    }
}

/// Requests a set of workers has sent and not yet seen answered.
#[derive(Default)]
pub struct InFlight(AtomicUsize);

impl InFlight {
    pub fn now(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// One client: a session and a loop of random lock operations, until told to stop or until
/// a request goes unanswered.
pub struct Worker {
    pub id: usize,
    pub rng: Rng,
    pub session: Option<String>,
    pub held: BTreeMap<usize, u64>,
    pub client: Client,
    pub ledger: Arc<Mutex<Ledger>>,
    pub stop: Arc<AtomicBool>,
    pub in_flight: Arc<InFlight>,
    /// Whether failures (no answer, 503) are expected: the node or its database is about to
    /// be taken away. Otherwise each is a violation.
    pub may_fail: bool,
    pub ttl_ms: u64,
    /// Upper bound on the worker's life, whatever happens.
    pub deadline: Instant,
}

/// What a worker leaves behind.
pub struct WorkerEnd {
    pub session: Option<String>,
    /// It stopped on a request left in doubt (sent, never answered, or answered 503).
    pub in_doubt: bool,
}

enum Step {
    Answer(Reply),
    /// The worker stops; `true` when the request's outcome is unknown.
    Stop(bool),
}

impl Worker {
    fn violation(&self, v: String) {
        let id = self.id;
        self.ledger
            .lock()
            .unwrap()
            .violation(format!("worker {id}: {v}"));
    }

    fn floor(&self) -> u64 {
        self.ledger.lock().unwrap().max_token
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        doubt: Option<Doubt>,
    ) -> Step {
        // A release or close is in doubt from before it is sent: another client may be
        // granted the key and say so before this one hears back.
        let early = matches!(doubt, Some(Doubt::Release { .. } | Doubt::Close { .. }));
        if early && let Some(d) = &doubt {
            self.ledger.lock().unwrap().doubts.push(d.clone());
        }
        self.in_flight.0.fetch_add(1, Ordering::SeqCst);
        let outcome = send(&self.client, method.clone(), path, body.as_ref()).await;
        self.in_flight.0.fetch_sub(1, Ordering::SeqCst);
        let mut l = self.ledger.lock().unwrap();
        let (what, unknown) = match outcome {
            Outcome::Reply(r) if r.status == 503 => {
                l.stats.unavailable += 1;
                (format!("503 {}", r.text), true)
            }
            Outcome::Reply(r) => return Step::Answer(r),
            Outcome::NotSent => {
                l.stats.not_sent += 1;
                ("not sent: connection refused".to_string(), false)
            }
            Outcome::InDoubt(e) => {
                l.stats.in_doubt += 1;
                (e, true)
            }
        };
        if !self.may_fail {
            l.violation(format!(
                "worker {}: {method} {path} failed on a node that should serve: {what}",
                self.id
            ));
        }
        if let Some(d) = doubt {
            if !unknown {
                l.settle(&d);
            } else if !early {
                l.doubts.push(d);
            }
        }
        Step::Stop(unknown)
    }

    pub async fn run(mut self) -> WorkerEnd {
        let keys = self.ledger.lock().unwrap().keys as u64;
        let end = |session, in_doubt| WorkerEnd { session, in_doubt };
        for _ in 0..1_000_000 {
            if self.stop.load(Ordering::SeqCst) || Instant::now() > self.deadline {
                break;
            }
            let Some(session) = self.session.clone() else {
                let body = json!({"owner": format!("load-{}", self.id), "ttl_ms": self.ttl_ms});
                match self
                    .request(Method::POST, "/v1/sessions", Some(body), None)
                    .await
                {
                    // An open in doubt leaves at most an unknown session, which holds nothing.
                    Step::Stop(d) => return end(None, d),
                    Step::Answer(r) if r.status == 201 => {
                        let id = r.body["session_id"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string();
                        self.ledger.lock().unwrap().ack_open(&id);
                        self.session = Some(id);
                    }
                    Step::Answer(r) => {
                        self.violation(format!("open: {} {}", r.status, r.text));
                        return end(None, false);
                    }
                }
                continue;
            };
            let roll = self.rng.below(100);
            let held: Vec<(usize, u64)> = self.held.iter().map(|(k, t)| (*k, *t)).collect();
            if (roll < 50 || held.is_empty()) && held.len() < 4 {
                let key = loop {
                    let k = self.rng.below(keys) as usize;
                    if !self.held.contains_key(&k) {
                        break k;
                    }
                };
                let wait_ms = if self.rng.below(4) == 0 { 50 } else { 0 };
                let path = format!("/v1/locks/{}/acquire", segment(&key_name(key)));
                let body = json!({"session_id": session, "wait_ms": wait_ms});
                let floor = self.floor();
                let doubt = Doubt::Acquire {
                    key,
                    session: session.clone(),
                    floor,
                };
                let r = match self
                    .request(Method::POST, &path, Some(body), Some(doubt))
                    .await
                {
                    Step::Answer(r) => r,
                    Step::Stop(d) => return end(Some(session), d),
                };
                match (r.status.as_u16(), r.body["token"].as_u64()) {
                    (200, Some(token)) => {
                        self.ledger
                            .lock()
                            .unwrap()
                            .ack_acquire(key, &session, token, floor);
                        self.held.insert(key, token);
                    }
                    (409, _) if r.body["error"] == "lock_held" => {
                        self.ledger.lock().unwrap().stats.busy += 1;
                    }
                    _ => {
                        self.violation(format!(
                            "acquire {} by {session}: {} {}",
                            key_name(key),
                            r.status,
                            r.text
                        ));
                        return end(Some(session), false);
                    }
                }
            } else if roll < 88 && !held.is_empty() {
                let (key, token) = held[self.rng.below(held.len() as u64) as usize];
                let path = format!("/v1/locks/{}/release", segment(&key_name(key)));
                let body = json!({"session_id": session, "token": token});
                let doubt = Doubt::Release { key, token };
                let r = match self
                    .request(Method::POST, &path, Some(body), Some(doubt))
                    .await
                {
                    Step::Answer(r) => r,
                    Step::Stop(d) => return end(Some(session), d),
                };
                if r.status == 200 {
                    self.ledger
                        .lock()
                        .unwrap()
                        .ack_release(key, &session, token);
                    self.held.remove(&key);
                } else {
                    self.violation(format!(
                        "release {} token {token} by its holder {session}: {} {}",
                        key_name(key),
                        r.status,
                        r.text
                    ));
                    return end(Some(session), false);
                }
            } else if roll < 94 {
                let path = format!("/v1/sessions/{session}/heartbeat");
                let r = match self
                    .request(Method::POST, &path, Some(json!({})), None)
                    .await
                {
                    Step::Answer(r) => r,
                    Step::Stop(d) => return end(Some(session), d),
                };
                if r.status == 200 {
                    self.ledger.lock().unwrap().stats.heartbeats += 1;
                } else {
                    self.violation(format!(
                        "heartbeat of live session {session}: {} {}",
                        r.status, r.text
                    ));
                    return end(Some(session), false);
                }
            } else {
                // Close the session, releasing what it holds; the next step opens another.
                let path = format!("/v1/sessions/{session}");
                let doubt = Doubt::Close {
                    session: session.clone(),
                };
                let r = match self.request(Method::DELETE, &path, None, Some(doubt)).await {
                    Step::Answer(r) => r,
                    Step::Stop(d) => return end(Some(session), d),
                };
                match (r.status.as_u16(), r.body["released"].as_u64()) {
                    (200, Some(n)) => {
                        self.ledger.lock().unwrap().ack_close(&session, n);
                        self.held.clear();
                        self.session = None;
                    }
                    _ => {
                        self.violation(format!("close of {session}: {} {}", r.status, r.text));
                        return end(Some(session), false);
                    }
                }
            }
        }
        end(self.session, false)
    }
}

async fn get(node: &Node, path: &str) -> Reply {
    node.get(path).await
}

/// Compares a node's view (the database's) with the ledger once the load has stopped, then
/// makes the ledger exactly what the database holds, every doubt resolved.
pub async fn verify(node: &Node, l: &mut Ledger, what: &str) {
    // Closes in doubt: the session is there or it is not, whole.
    let doubts = l.doubts.clone();
    for d in &doubts {
        if let Doubt::Close { session } = d {
            let r = get(node, &format!("/v1/sessions/{session}")).await;
            match r.status.as_u16() {
                200 => {}
                404 => {
                    l.stats.doubts_that_committed += 1;
                    l.drop_session(session);
                }
                _ => l.violation(format!(
                    "{what}: GET session {session}: {} {}",
                    r.status, r.text
                )),
            }
        }
    }

    // Every key: who holds it now, against what was acknowledged and what is in doubt.
    for k in 0..l.keys {
        let name = key_name(k);
        let r = get(node, &format!("/v1/locks/{}", segment(&name))).await;
        let now = match r.status.as_u16() {
            200 => Some((
                r.body["session_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                r.body["token"].as_u64().unwrap_or(0),
            )),
            404 if r.body["error"] == "lock_free" => None,
            _ => {
                l.violation(format!("{what}: GET lock {name}: {} {}", r.status, r.text));
                continue;
            }
        };
        let acked: Vec<(u64, String)> = l.live[k].iter().map(|(t, s)| (*t, s.clone())).collect();
        match now {
            Some((s, t)) if acked.iter().any(|(at, as_)| *at == t && *as_ == s) => {
                for (at, as_) in acked {
                    if at != t {
                        if !l.release_in_doubt(k, at, &as_) {
                            l.violation(format!(
                                "{what}: {name} is held by {s} with token {t}, but the \
                                 acknowledged grant {at} to {as_} was never released"
                            ));
                        }
                        l.live[k].remove(&at);
                    }
                }
            }
            Some((s, t)) => {
                let floor = doubts.iter().find_map(|d| match d {
                    Doubt::Acquire {
                        key,
                        session,
                        floor,
                    } if *key == k && *session == s => Some(*floor),
                    _ => None,
                });
                match floor {
                    Some(floor) => {
                        l.stats.doubts_that_committed += 1;
                        l.fresh_token(k, t, floor, &format!("{what}: acquire in doubt"));
                        l.take_key(k, &s, t, &format!("{what}: acquire in doubt"));
                    }
                    None => l.violation(format!(
                        "{what}: {name} is held by {s} with token {t}, which no acknowledged \
                         or pending request explains (the ledger has {acked:?})"
                    )),
                }
            }
            None => {
                for (at, as_) in acked {
                    if l.release_in_doubt(k, at, &as_) {
                        l.stats.doubts_that_committed += 1;
                    } else {
                        l.violation(format!(
                            "{what}: {name} is free, but its acknowledged grant (token {at} \
                             to {as_}) was never released: an acknowledged grant was lost"
                        ));
                    }
                    l.live[k].remove(&at);
                }
            }
        }
    }
    l.doubts.clear();
    l.superseded.clear();

    // Every acknowledged session is there and holds exactly what the ledger says.
    let open: Vec<String> = l.open.iter().cloned().collect();
    for s in open {
        let r = get(node, &format!("/v1/sessions/{s}")).await;
        if r.status != 200 {
            l.violation(format!(
                "{what}: acknowledged session {s} is gone: {} {}",
                r.status, r.text
            ));
            l.drop_session(&s);
            continue;
        }
        let mut locks: BTreeMap<usize, u64> = BTreeMap::new();
        for g in r.body["locks"].as_array().cloned().unwrap_or_default() {
            let key = g["key"].as_str().unwrap_or_default();
            match (0..l.keys).find(|k| key_name(*k) == key) {
                Some(k) => {
                    locks.insert(k, g["token"].as_u64().unwrap_or(0));
                }
                None => l.violation(format!("{what}: session {s} holds unknown key {key}")),
            }
        }
        let held = l.holdings(&s);
        if locks != held {
            l.violation(format!(
                "{what}: session {s} holds {locks:?}, the lock table says {held:?}"
            ));
        }
    }
    // Closed sessions stay closed.
    let closed: Vec<String> = l.closed.iter().cloned().collect();
    for s in closed {
        let r = get(node, &format!("/v1/sessions/{s}")).await;
        if r.status != 404 {
            l.violation(format!(
                "{what}: closed session {s} is back: {} {}",
                r.status, r.text
            ));
        }
    }
}

/// A fresh grant through `node` must be above every token seen so far.
pub async fn probe(node: &Node, l: &mut Ledger, key: &str, what: &str) {
    let s = node.open("probe", 60_000).await;
    let r = node
        .post(
            &format!("/v1/locks/{}/acquire", segment(key)),
            json!({"session_id": s}),
        )
        .await;
    let token = r.body["token"].as_u64().unwrap_or(0);
    if r.status != 200 || token <= l.max_token {
        l.violation(format!(
            "{what}: a fresh grant through {} is {} {} — every earlier token is at most {}",
            node.name(),
            r.status,
            r.text,
            l.max_token
        ));
    }
    l.max_token = l.max_token.max(token);
    l.seen.insert(token);
    let r = node.delete(&format!("/v1/sessions/{s}")).await;
    if r.status != 200 || r.body["released"] != 1 {
        l.violation(format!(
            "{what}: closing the probe session: {} {}",
            r.status, r.text
        ));
    }
}

/// Starts one worker per slot; slot `i` goes to `nodes[i % nodes.len()]`.
#[allow(clippy::too_many_arguments)]
pub fn spawn_workers(
    slots: &mut [Option<String>],
    clients: &[(Client, bool, Arc<InFlight>)],
    ledger: &Arc<Mutex<Ledger>>,
    stop: &Arc<AtomicBool>,
    rng: &mut Rng,
    ttl_ms: u64,
    limit: Duration,
) -> Vec<tokio::task::JoinHandle<WorkerEnd>> {
    let mut tasks = Vec::with_capacity(slots.len());
    for (i, slot) in slots.iter_mut().enumerate() {
        let (client, may_fail, in_flight) = &clients[i % clients.len()];
        let session = slot.take();
        let held = match &session {
            Some(s) => ledger.lock().unwrap().holdings(s),
            None => BTreeMap::new(),
        };
        let w = Worker {
            id: i,
            rng: Rng::new(rng.next()),
            session,
            held,
            client: client.clone(),
            ledger: ledger.clone(),
            stop: stop.clone(),
            in_flight: in_flight.clone(),
            may_fail: *may_fail,
            ttl_ms,
            deadline: Instant::now() + limit,
        };
        tasks.push(tokio::spawn(w.run()));
    }
    tasks
}

/// Waits (bounded) for the workers; puts each one's session back in its slot when the ledger
/// still has it open. Returns how many stopped on a request in doubt.
pub async fn join_workers(
    tasks: Vec<tokio::task::JoinHandle<WorkerEnd>>,
    slots: &mut [Option<String>],
    limit: Duration,
) -> usize {
    let mut doubts = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        let end = tokio::time::timeout(limit, t)
            .await
            .unwrap_or_else(|_| panic!("worker {i} did not stop within {limit:?}"))
            .expect("worker panicked");
        doubts += usize::from(end.in_doubt);
        slots[i] = end.session;
    }
    doubts
}

/// After a verification: each slot keeps its session only if the ledger has it open.
pub fn settle_slots(slots: &mut [Option<String>], l: &Ledger) {
    for s in slots.iter_mut() {
        if s.as_ref().is_some_and(|id| !l.open.contains(id)) {
            *s = None;
        }
    }
}
