//! Placeholder of the threaded device tests that `cargo xtask test` also runs under ThreadSanitizer
//! (every `tests/device_threads*.rs`): threads open the device, create completion queues and poll
//! them, and a connected pair is driven from three threads. Fails, never skips, without a device.

mod common;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use ibverbs::{Completion, Error, Local, RecvRequest, SendRequest};

#[test]
fn threads_open_the_device_and_poll_their_cqs() {
    let shared = Arc::new(context());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let shared = Arc::clone(&shared);
            thread::spawn(move || {
                let own = context();
                let mut cqs = [own.create_cq(16, None).unwrap(), shared.create_cq(16, None).unwrap()];
                let mut wcs: [Completion; 4] = Default::default();
                for _ in 0..100 {
                    for cq in &mut cqs {
                        assert!(cq.poll(&mut wcs).unwrap().is_empty());
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn a_pair_driven_from_three_threads() {
    let Pair { pd, mut cq_a, mut cq_b, mut a, mut b, ctx: _ctx } = rc_pair(16);
    let n = 50u64;
    let pd2 = pd.clone();
    let receiver = thread::spawn(move || {
        let mut sum = 0;
        for i in 0..n {
            b.post_recv(RecvRequest::new(Local::whole(pd2.allocate(8).unwrap())).wr_id(i)).unwrap();
            let mut c = poll_one(&mut cq_b);
            assert!(c.is_ok(), "{c:?}");
            sum += u64::from_le_bytes(c.take_region().unwrap()[..8].try_into().unwrap());
        }
        sum
    });
    let poller = thread::spawn(move || {
        for _ in 0..n {
            assert!(poll_one(&mut cq_a).is_ok());
        }
    });
    for i in 0..n {
        let mut m = pd.allocate(8).unwrap();
        m.copy_from_slice(&i.to_le_bytes());
        // A full send queue empties as the poller reaps completions; rnr_retry waits for the receiver.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match a.post_send(SendRequest::send(Local::whole(m))) {
                Ok(()) => break,
                Err(e) if matches!(e.error, Error::QueueFull { .. }) && Instant::now() < deadline => {
                    m = e.request.into_buffers().next().unwrap().into_region().unwrap();
                    thread::yield_now();
                }
                Err(e) => panic!("{}", e.error),
            }
        }
    }
    poller.join().unwrap();
    assert_eq!(receiver.join().unwrap(), n * (n - 1) / 2);
}
