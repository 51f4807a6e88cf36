//! Arbitrary bytes as a stored record or a request body: decoding may refuse them, never
//! panic. A data file damaged on disk must give an error, not take the server down.
#![no_main]

use leasehold::domain::{Event, JobRecord, LockRecord, PoolRecord, SeatRecord, SessionRecord};
use leasehold::backend::embedded::store::codec::decode;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode::<SessionRecord>(data);
    let _ = decode::<LockRecord>(data);
    let _ = decode::<PoolRecord>(data);
    let _ = decode::<SeatRecord>(data);
    let _ = decode::<JobRecord>(data);
    let _ = decode::<Event>(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = leasehold::domain::LockKey::parse("key", text);
        let _ = leasehold::domain::SessionId::parse("session_id", text);
    }
});
