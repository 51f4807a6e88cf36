//! Record encoding: one format byte, then postcard.
//!
//! The format byte lets a later release read old records and migrate them; it is only ever
//! added to. Postcard's wire format is stable since 1.0.

use serde::{Deserialize, Serialize, de::DeserializeOwned};

/// The format every record is written in today.
pub const FORMAT_V1: u8 = 1;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("record is empty")]
    Empty,
    #[error("record has format {0}, this build reads format {FORMAT_V1}")]
    UnknownFormat(u8),
    #[error("record does not decode: {0}")]
    Postcard(#[from] postcard::Error),
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut buf = vec![FORMAT_V1];
    // Serializing plain structs into a Vec cannot fail.
    postcard::to_io(value, &mut buf).expect("postcard encodes into a Vec");
    buf
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_head(bytes)
}

/// Decodes the leading fields of a record, borrowing its text from `bytes`: for a reader
/// that needs one field of a record and not a copy of all of it. Postcard is positional and
/// fields are only appended, so a struct of a record's first fields reads its bytes.
pub fn decode_head<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, CodecError> {
    match bytes.split_first() {
        None => Err(CodecError::Empty),
        Some((&FORMAT_V1, rest)) => Ok(postcard::from_bytes(rest)?),
        Some((&other, _)) => Err(CodecError::UnknownFormat(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{LockRecord, SessionId, Token, UnixMs};

    #[test]
    fn round_trip_and_format_byte() {
        let rec = LockRecord {
            session_id: SessionId::random(),
            token: Token(42),
            acquired_at: UnixMs(1_700_000_000_000),
        };
        let bytes = encode(&rec);
        assert_eq!(bytes[0], FORMAT_V1);
        assert_eq!(decode::<LockRecord>(&bytes).unwrap(), rec);
        let mut future = bytes.clone();
        future[0] = 9;
        assert!(matches!(
            decode::<LockRecord>(&future),
            Err(CodecError::UnknownFormat(9))
        ));
        assert!(matches!(decode::<LockRecord>(&[]), Err(CodecError::Empty)));
        assert!(decode::<LockRecord>(&bytes[..5]).is_err());
    }
}
