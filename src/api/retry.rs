//! The `request_id` of a mutating call, turned into what the backend remembers it by: the
//! id is checked (1 to 128 of `A-Z a-z 0-9 - _ . : ~`), scoped to the calling token, and
//! paired with a fingerprint of the call, so a reuse for another call is refused rather
//! than answered with someone else's answer.

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::gate::Caller;
use crate::backend::requests::{MAX_REQUEST_ID_LEN, Request, valid_request_id};

/// The request for `request_id`, if the call carried one. `route` names the operation and
/// `resource` the key, pool or queue in its path; `asked` is everything the body asks except
/// the id itself and how long to wait (a retry may wait less).
pub fn request(
    caller: &Caller,
    request_id: Option<String>,
    route: &str,
    resource: &str,
    asked: Value,
) -> Result<Option<Request>, ApiError> {
    let Some(id) = request_id else {
        return Ok(None);
    };
    if !valid_request_id(&id) {
        return Err(ApiError::invalid(
            "request_id",
            format!(
                "request_id must be 1 to {MAX_REQUEST_ID_LEN} characters of A-Z, a-z, 0-9, \
                 '-', '_', '.', ':' and '~'"
            ),
        ));
    }
    // Scoped per token by a digest of its name: two tokens never share a record, and the
    // stored key does not name the token.
    let scope = hex(&Sha256::digest(format!("token\0{}", caller.name()).as_bytes())[..16]);
    // serde_json's maps are ordered, so the same body always gives the same text.
    let what = format!("{route}\0{resource}\0{asked}");
    Ok(Some(Request {
        key: format!("{scope}/{id}"),
        fingerprint: hex(&Sha256::digest(what.as_bytes())),
    }))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ids_are_scoped_and_calls_fingerprinted() {
        let open = Caller::Open;
        let a = request(&open, Some("r-1".into()), "acquire", "k", json!({"s": 1}))
            .unwrap()
            .unwrap();
        let same = request(&open, Some("r-1".into()), "acquire", "k", json!({"s": 1}))
            .unwrap()
            .unwrap();
        assert_eq!(a, same);
        let other_key = request(&open, Some("r-1".into()), "acquire", "j", json!({"s": 1}))
            .unwrap()
            .unwrap();
        assert_eq!(a.key, other_key.key);
        assert_ne!(a.fingerprint, other_key.fingerprint);
        let other_route = request(&open, Some("r-1".into()), "release", "k", json!({"s": 1}))
            .unwrap()
            .unwrap();
        assert_ne!(a.fingerprint, other_route.fingerprint);
        assert!(
            request(&open, None, "acquire", "k", json!({}))
                .unwrap()
                .is_none()
        );
        for bad in ["", "a b", "x/y"] {
            assert!(request(&open, Some(bad.into()), "acquire", "k", json!({})).is_err());
        }
    }
}
