//! The shortest path through the product: open, lock, fence, expire, reap.
mod common;

use common::TestServer;

#[tokio::test]
async fn open_lock_expire_reap() {
    let s = TestServer::start().await;
    let a = s.open("alice", 2_000).await;
    let got = s.acquire("db/migrate", &a).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let token = got.body["token"].as_u64().unwrap();
    let fence = s
        .get(&format!("/v1/fence/db%2Fmigrate?token={token}"))
        .await;
    assert_eq!(fence.body["current"], true);
    s.advance(2_000).await;
    let reaped = s.reap().await;
    assert_eq!(reaped.body["sessions_ended"], 1);
    assert_eq!(reaped.body["locks_released"], 1);
    assert_eq!(s.get("/v1/locks/db%2Fmigrate").await.status, 404);
    assert_eq!(s.heartbeat(&a).await.status, 404);
    s.stop().await;
}
