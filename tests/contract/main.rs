//! The contract suite: every operation, error and invariant of API v1, written once and run
//! through the real HTTP server against every backend, each test on a fresh server (a fresh
//! data directory, or a fresh PostgreSQL namespace) driven by a manual clock.
//!
//! Each test is an `async fn name(s: &TestServer)` in the module of its resource; the
//! `contract!` list below makes one `#[tokio::test]` of it per backend, as
//! `embedded::<module>::<name>`, `postgres::<module>::<name>` and `redis::<module>::<name>`,
//! so the backends cannot drift: a test cannot be written for one and forgotten for another.
//!
//! Where the backends legitimately differ, the test says so where it asserts. On PostgreSQL
//! the database clock judges expiry and stamps every time in an answer; the harness pins
//! that clock to the manual clock (see `common`), so the same instants are asserted on both.
//! On Redis the script's clock judges expiry; the harness pins it the same way.
//!
//! What is embedded-only by nature (injected storage faults, the node's own clock judging
//! expiry, the writer's paced reaper passes, the restart grace, the redb file) lives in
//! `tests/http.rs`, `tests/restart.rs` and `tests/crash.rs`, each saying why.
//!
//! Run one backend: `cargo test --test contract embedded::` (or `postgres::`, which needs the
//! database at `LEASEHOLD_TEST_POSTGRES_URL`, by default
//! `postgres://postgres@127.0.0.1:5432/test`), or `redis::`, which needs Redis at
//! `LEASEHOLD_TEST_REDIS_URL`, by default `redis://127.0.0.1:6379/0`).

#[path = "../common/mod.rs"]
mod common;

mod audit;
mod durability;
mod jobs;
mod locks;
mod pools;
mod retries;
mod service;
mod sessions;
mod waiters;
mod watch;

/// One `#[tokio::test]` per backend and listed test. An entry is the test's name, then
/// optionally `on Real` (the real clock instead of the manual one) and `with <tweak>` (a
/// closure that changes the server's configuration).
macro_rules! contract {
    (@clock) => { crate::common::ClockKind::Manual };
    (@clock $clock:ident) => { crate::common::ClockKind::$clock };
    (@tweak) => { |_: &mut leasehold::config::Config| {} };
    (@tweak $tweak:expr) => { $tweak };
    (@backend $kind:ident;
        $($group:ident {
            $($test:ident $(on $clock:ident)? $(with $tweak:expr)?),* $(,)?
        })*
    ) => {
        $(
            mod $group {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    // The suite hands every test the server it may restart; most only read it.
                    #[allow(clippy::unnecessary_mut_passed)]
                    async fn $test() {
                        let mut s = crate::common::TestServer::start_clocked(
                            crate::common::BackendKind::$kind,
                            contract!(@clock $($clock)?),
                            contract!(@tweak $($tweak)?),
                        )
                        .await;
                        crate::$group::$test(&mut s).await;
                        s.stop().await;
                    }
                )*
            }
        )*
    };
    ($($suite:tt)*) => {
        mod embedded {
            contract!(@backend Embedded; $($suite)*);
        }
        mod postgres {
            contract!(@backend Postgres; $($suite)*);
        }
        mod redis {
            contract!(@backend Redis; $($suite)*);
        }
    };
}

contract! {
    service {
        probes_answer_when_healthy,
        metrics_exist_and_count,
        malformed_json_is_400,
        trailing_bytes_after_the_json_body_are_400,
        body_over_max_body_bytes_is_413,
        wrong_method_is_405,
        unknown_path_is_404_not_found,
    }
    sessions {
        open_returns_201_with_id_ttl_deadline_and_revision,
        show_session_round_trips_owner_metadata_and_locks,
        open_rejects_bad_input_naming_the_field,
        open_rejects_missing_and_unknown_fields,
        missing_and_unknown_fields_are_named_in_field,
        heartbeat_extends_and_gone_is_terminal,
        heartbeat_expired_but_unreaped_is_gone_and_not_revived,
        heartbeat_with_ttl_changes_the_ttl,
        grace_state_after_a_third_of_the_ttl,
        close_releases_everything_and_is_idempotent,
        closing_an_expired_session_is_recorded_as_its_expiry,
        invalid_session_id_in_path_is_400,
        sessions_page_by_owner_and_cursor,
        sessions_list_rejects_bad_query,
        next_is_null_on_a_full_last_page,
    }
    locks {
        acquire_show_release,
        holder_reacquire_is_idempotent,
        acquire_held_lock_without_wait_is_409,
        one_winner_among_concurrent_contenders,
        acquire_for_unknown_or_gone_session_is_404,
        acquire_and_release_reject_bad_bodies,
        release_with_wrong_token_or_session_is_409,
        too_many_locks_is_409 with |c| c.max_locks_per_session = 2,
        any_valid_key_works_percent_encoded,
        invalid_keys_are_400,
        a_plus_in_a_path_is_a_plus_not_a_space,
        locks_page_by_prefix_and_cursor,
        fence_reports_current_and_latest,
    }
    waiters {
        waiters_are_served_first_come_first_served,
        waiter_is_served_when_the_holder_closes_or_is_reaped,
        a_waiter_whose_session_ended_is_skipped,
        wait_timeout_is_409_on_the_real_clock on Real,
        wait_is_capped_by_max_wait_ms on Real with |c| c.max_wait_ms = 200,
        wait_timeout_is_409_on_the_manual_clock,
        inline_reap_of_an_expired_holder,
        waiters_keep_their_order_when_a_newcomer_reaps_the_holder_inline,
        a_newcomer_does_not_overtake_a_waiter_when_the_holder_expires,
    }
    audit {
        events_cover_every_kind_and_page_by_cursor,
        events_reject_bad_query,
        events_are_trimmed_by_retention_in_bounded_batches with |c| {
            c.event_retention_ms = 1_000;
            c.event_trim_batch = 2;
        },
        admin_end_is_audited_and_releases,
        dry_run_reap_changes_nothing_then_a_real_reap_ends_them,
        the_dry_run_changes_nothing_and_lists_seats_and_job_actions,
        a_real_reap_reports_the_seats_and_jobs_it_settled,
        operator_and_admin_actions_name_their_token with crate::audit::with_actor_tokens,
    }
    pools {
        pool_create_resize_show_list_delete,
        resizing_a_pool_keeps_its_created_at,
        pool_bad_input_is_400_naming_the_field,
        missing_and_unknown_fields_are_named_in_field,
        seat_acquire_show_release,
        seat_reacquire_is_idempotent,
        seat_errors,
        seat_tokens_share_the_global_counter_with_lock_tokens,
        seat_waiters_are_served_first_come_first_served,
        a_seat_waiter_times_out_with_pool_exhausted,
        a_timed_out_seat_waiter_counts_as_refused,
        a_seat_waiter_whose_session_ended_is_skipped,
        deleting_a_pool_answers_its_waiters_pool_not_found,
        waits_are_capped_by_max_wait_ms with |c| c.max_wait_ms = 1_000,
        heartbeats_keep_seats_and_claims_alive,
        concurrent_seat_requests_never_exceed_capacity,
        growing_a_pool_serves_its_waiters_in_order,
        shrinking_below_use_takes_no_seat_away,
        a_zombie_seat_goes_at_once_to_a_contender,
        a_zombie_seat_is_reclaimed_by_the_reaper_and_goes_to_the_first_waiter,
        a_zombie_seat_goes_to_the_first_waiter_not_to_a_newcomer,
        zombie_seats_serve_the_waiters_first_and_then_a_newcomer,
        ending_a_session_reclaims_every_seat_with_its_reason,
        deleting_a_pool_in_use_is_409,
        a_seat_holder_past_its_deadline_cannot_release_and_its_seat_is_reclaimed,
    }
    jobs {
        enqueue_claim_complete_round_trip,
        a_complete_without_result_and_defaults,
        a_worker_fail_records_its_reason,
        a_worker_fail_is_counted_in_jobs_failed_total,
        job_errors,
        claim_with_no_job_is_204,
        a_claim_waits_for_an_enqueue,
        a_claim_waiter_whose_session_ended_is_skipped,
        concurrent_claims_hand_each_job_out_once,
        a_waiting_claim_times_out_with_204,
        a_recovered_job_goes_to_its_new_claimant_and_the_old_worker_is_fenced_off,
        a_late_worker_past_its_deadline_cannot_finish_and_its_job_is_recovered,
        a_non_idempotent_job_fails_when_its_worker_dies,
        the_recovery_cap_fails_a_job_and_an_admin_requeue_sends_it_back,
        a_requeued_job_goes_to_the_tail_of_its_queue,
        a_recovered_job_goes_to_the_head_of_its_queue,
        release_hands_a_job_back_without_counting_a_recovery,
        payload_round_trips_and_its_size_is_limited,
        a_payload_or_result_over_64_kib_is_refused,
        job_bad_input_is_400_naming_the_field,
        job_lists_page_by_cursor,
        finished_jobs_are_purged_after_their_retention with |c| c.job_retention_ms = 10_000,
        purged_jobs_leave_the_job_gauges with |c| c.job_retention_ms = 10_000,
    }
    retries {
        a_repeated_enqueue_acts_once,
        a_repeated_acquire_and_release_act_once,
        a_failed_call_is_not_remembered,
        a_request_id_reused_for_another_call_is_refused,
        a_request_id_is_forgotten_after_its_retention with |c| c.request_id_retention_ms = 1_000,
        concurrent_retries_with_one_request_id_act_once,
        retries_of_a_waiting_acquire_get_its_grant,
        a_request_id_survives_a_restart,
        a_repeated_open_opens_one_session,
        a_repeated_seat_acquire_and_release_act_once,
        a_repeated_claim_and_finish_act_once,
        retries_of_a_waiting_claim_get_its_job,
    }
    watch {
        a_watcher_sees_grace_then_the_expiry_with_each_lock_and_seat_lost with crate::watch::quick,
        a_watcher_sees_an_operator_end with crate::watch::quick,
        a_watcher_sees_its_client_close with crate::watch::quick,
        watching_a_gone_session_is_404,
        watching_a_session_closed_a_moment_before_is_404_at_once,
        a_reaper_end_reaches_a_watcher_without_a_recheck with |c| {
            // Re-checks never come within the test: only the backend's signal of ends can
            // bring the end to the watcher in time.
            c.watch_recheck_ms = 60_000;
            c.reaper_enabled = true;
            c.reaper_interval_ms = 50;
        },
        a_shutdown_ends_every_watch_rather_than_waiting_on_it with |c| {
            crate::watch::quick(c);
            c.shutdown_grace_ms = 60_000;
        },
        watches_over_the_cap_are_refused with |c| {
            crate::watch::quick(c);
            c.max_watches = 1;
            c.max_watches_per_token = 1;
        },
    }
    durability {
        seats_and_jobs_survive_a_restart,
        pool_and_job_gauges_are_republished_after_a_restart,
    }
}
