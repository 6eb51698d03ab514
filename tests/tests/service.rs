//! The engine worker thread: concurrent requests through handles, aborts and dropped handles free the cache.

use std::time::{Duration, Instant};

use nextn_engine::spec::SpecConfig;
use nextn_engine::{
    Engine, EngineConfig, EngineService, FinishReason, LoadOptions, Model, RecvError, RequestEvent, SamplingParams,
};
use nextn_tests::{fixture, reference};

fn service(name: &'static str, spec: Option<SpecConfig>) -> EngineService {
    EngineService::spawn(move || {
        let model = Model::load(&fixture(name), &LoadOptions::default()).expect("fixture loads");
        Engine::new(model, None, Vec::new(), EngineConfig { spec, ..Default::default() })
    })
    .expect("service starts")
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ..SamplingParams::greedy() }
}

/// Wait until the worker reports nothing held (it publishes after each command batch).
fn wait_idle(handle: &nextn_engine::EngineHandle) -> nextn_engine::ServiceSnapshot {
    let start = Instant::now();
    loop {
        let s = handle.snapshot();
        if (s.running == 0 && s.kv_blocks_used == 0 && s.state_slots_used == 0) || start.elapsed() > Duration::from_secs(10) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn concurrent_requests_through_handles_match_the_reference() {
    for spec in [None, Some(SpecConfig { draft_steps: 3 })] {
        let svc = service("qwen3_5_moe", spec);
        let cases = reference("qwen3_5_moe").cases;
        let n = cases.len().min(3);
        assert!(n >= 2, "the fixture has at least two reference cases");
        let threads: Vec<_> = cases
            .iter()
            .take(3)
            .map(|case| {
                let handle = svc.handle();
                let (prompt, want) = (case.input_ids.clone(), case.greedy_ids.clone());
                std::thread::spawn(move || {
                    let mut req = handle.submit(prompt, greedy(want.len()));
                    let mut streamed = Vec::new();
                    loop {
                        match req.recv_deadline(None).expect("event") {
                            RequestEvent::Token(t) => streamed.push(t.token),
                            RequestEvent::Finished(out) => return (out, streamed, want),
                            RequestEvent::Failed(e) => panic!("request failed: {e}"),
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            let (out, streamed, want) = t.join().expect("thread");
            assert_eq!(out.token_ids, want, "spec {spec:?}");
            assert_eq!(streamed, want, "streamed tokens = output (spec {spec:?})");
            assert_eq!(out.finish_reason, FinishReason::Length);
        }
        let snap = wait_idle(&svc.handle());
        assert_eq!((snap.kv_blocks_used, snap.state_slots_used, snap.running), (0, 0, 0));
        assert_eq!(snap.requests_finished, n as u64);
    }
}

#[test]
fn abort_and_dropped_handles_free_blocks_and_slots() {
    let svc = service("qwen3_5_moe", Some(SpecConfig { draft_steps: 2 }));
    let handle = svc.handle();
    let prompt = reference("qwen3_5_moe").cases[0].input_ids.clone();
    // An explicit abort after the first token: the output so far comes back with finish reason `abort`.
    let mut req = handle.submit(prompt.clone(), greedy(10_000.min(handle.info().max_model_len - prompt.len() - 8)));
    let first = req.recv_deadline(Some(Instant::now() + Duration::from_secs(30))).expect("first event");
    assert!(matches!(first, RequestEvent::Token(_)));
    req.abort();
    let out = loop {
        match req.recv_deadline(Some(Instant::now() + Duration::from_secs(30))).expect("finish arrives") {
            RequestEvent::Finished(out) => break out,
            RequestEvent::Token(_) => {}
            RequestEvent::Failed(e) => panic!("{e}"),
        }
    };
    assert_eq!(out.finish_reason, FinishReason::Abort);
    assert!(!out.token_ids.is_empty());
    // Dropped handles (a client that went away), some before admission, some mid-decode.
    for _ in 0..6 {
        let r = handle.submit(prompt.clone(), greedy(200));
        drop(r);
    }
    let mut r = handle.submit(prompt.clone(), greedy(200));
    assert!(matches!(r.recv_deadline(Some(Instant::now() + Duration::from_secs(30))), Ok(RequestEvent::Token(_))));
    drop(r);
    let snap = wait_idle(&handle);
    assert_eq!((snap.kv_blocks_used, snap.state_slots_used, snap.running, snap.waiting), (0, 0, 0, 0), "{snap:?}");
    assert!(snap.requests_aborted >= 2);
    // A deadline that passes returns `Timeout` and leaves the request running; dropping it then frees it.
    let n = 400.min(handle.info().max_model_len - prompt.len() - 8);
    let mut r = handle.submit(prompt, greedy(n));
    let mut timed_out = false;
    for _ in 0..1000 {
        match r.recv_deadline(Some(Instant::now())) {
            Err(RecvError::Timeout) => {
                timed_out = true;
                break;
            }
            Ok(RequestEvent::Token(_)) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(timed_out, "a deadline in the past must time out while tokens are still coming");
    drop(r);
    let snap = wait_idle(&handle);
    assert_eq!((snap.kv_blocks_used, snap.state_slots_used), (0, 0), "{snap:?}");
}

#[test]
fn a_bad_request_fails_with_a_message_and_the_service_keeps_serving() {
    let svc = service("qwen3_5_moe", None);
    let handle = svc.handle();
    let mut bad = handle.submit(vec![u32::MAX], greedy(4));
    match bad.recv_deadline(None).expect("event") {
        RequestEvent::Failed(e) => assert!(e.to_string().contains("out of range"), "{e}"),
        other => panic!("expected a failure, got {other:?}"),
    }
    let case = &reference("qwen3_5_moe").cases[0];
    let mut good = handle.submit(case.input_ids.clone(), greedy(3));
    let out = loop {
        if let RequestEvent::Finished(out) = good.recv_deadline(None).expect("event") {
            break out;
        }
    };
    assert_eq!(out.token_ids, case.greedy_ids[..3]);
    assert_eq!(handle.snapshot().requests_failed, 1);
}
