//! The token floor on PostgreSQL: `{ns}.revision`, the sequence every token is drawn from,
//! raised to at least the floor in one transaction that holds off every other draw.

use super::{Postgres, transact};
use crate::backend::{BackendError, Result};
use crate::domain::state::{FloorRaised, floor_detail, validate_token_floor};

/// Takes the sequence's SHARE ROW EXCLUSIVE lock, which `nextval` (ROW EXCLUSIVE, held to the
/// end of the drawing transaction) conflicts with: once granted, every transaction that drew
/// a token has ended and no other can draw one until this one commits. Without it, draws
/// between reading the counter and `setval` could pass the floor, and `setval` would move the
/// counter back under them. `NO CYCLE` is what the sequence already is; the statement
/// changes nothing else.
const LOCK_SEQUENCE: &str = "ALTER SEQUENCE {ns}.revision NO CYCLE";

const LAST_DRAWN: &str = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {ns}.revision";

const SET_COUNTER: &str = "SELECT setval('{ns}.revision', $1, true)";

/// The raise's own revision and its audit event.
const RECORD: &str = "
WITH r AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision),
e AS (INSERT INTO {ns}.event (kind, detail, actor) VALUES ('token_floor_raised', $1, $2::text))
SELECT revision FROM r";

impl Postgres {
    pub async fn raise_token_floor(&self, floor: u64) -> Result<FloorRaised> {
        validate_token_floor(floor)?;
        let raised = transact!(self, |tx, after| {
            tx.batch_execute(&self.sql(LOCK_SEQUENCE)).await?;
            let previous = self
                .q_one(&tx, LAST_DRAWN, &[])
                .await?
                .map_or(0, |r| r.get::<_, i64>(0) as u64);
            if floor > previous {
                self.q(&tx, SET_COUNTER, &[&(floor as i64)]).await?;
            }
            let detail = floor_detail(floor, previous);
            let revision = self
                .q_one(&tx, RECORD, &[&detail, &self.actor()])
                .await?
                .map(|r| r.get::<_, i64>(0) as u64)
                .ok_or(super::Fail::Answer(BackendError::Unavailable(
                    "the token floor raise returned nothing".into(),
                )))?;
            FloorRaised {
                floor,
                previous,
                revision,
            }
        })?;
        tracing::info!(
            floor,
            previous = raised.previous,
            revision = raised.revision,
            "raised the token floor"
        );
        Ok(raised)
    }
}
