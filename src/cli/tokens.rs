//! `leasehold tokens`: the fencing-token commands against a running server.

use clap::Subcommand;
use serde_json::json;

use crate::client::{Client, ClientError};

#[derive(Subcommand)]
pub enum TokensAction {
    /// Raise the token floor: every fencing token issued afterwards is greater than FLOOR
    /// (audited; the counter never moves back). Use it after restoring a backend's database
    /// from a backup, with FLOOR at or above the last token the lost state issued.
    RaiseFloor {
        /// Every later token is greater than this (at most 2^62).
        floor: u64,
    },
}

pub async fn run(server: &str, action: TokensAction) -> Result<(), ClientError> {
    let client = Client::new(server)?;
    match action {
        TokensAction::RaiseFloor { floor } => super::remote::print(
            client
                .post("/v1/admin/tokens/floor", &json!({ "floor": floor }))
                .await?,
        ),
    }
}
