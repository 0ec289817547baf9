//! The bare producer (make bench, section 11): produces every message of a file to one topic with
//! the relay's producer settings (src/sinks/kafka.rs: acks=all, idempotence, murmur2_random,
//! linger.ms=1, message.max.bytes 1,000,000), all in flight at once, waits for every delivery
//! report and checks that each one succeeded. No database: the ceiling the relay is measured
//! against.
//!
//! Usage: kafka_producer <host:port> <topic> <messages file> [base | future | paced <messages/s> [count]]
//!
//! The file is a run of messages, each: key (u32 length, bytes), value (u32 length, bytes),
//! header count (u32), then per header its name (u32 length, bytes) and value (u32 length, bytes;
//! u32::MAX for none). Integers little-endian.
//!
//! `base` (default): a BaseProducer whose delivery callback counts reports, polled by this thread.
//! `future`: a FutureProducer, one future per message awaited together after the last send, as
//! the relay awaits a batch's reports (one batch of the whole file).
//!
//! `paced <r> [count]`: `count` messages (the file's, over again as needed; default all of them
//! once), one every 1/r s (sleeping between sends, never spinning) with a
//! ThreadedProducer, whose own thread serves each delivery report as it comes: the broker's
//! send-to-acknowledgement time per message, as the relay would see it for a lone event.
//!
//! Before the clock starts, the producer is made, reads the topic's metadata and has one message
//! acknowledged on `<topic>-warmup` (connections and the idempotent producer's id are in place):
//! that is `connect_s`. Prints one line: `messages <n> connect_s <s> produce_s <s> rate
//! <messages/s>`, produce_s from the first send to the last delivery report; paced adds `p50_ms
//! <ms> p95_ms <ms> p99_ms <ms> max_ms <ms>` of send to delivery report.
//!
//! KAFKA_PRODUCER_SET=name=value,... adds librdkafka settings, for a diagnosis (make bench sets
//! none).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, FutureProducer, FutureRecord, Producer, ProducerContext, ThreadedProducer};

struct Message {
    key: Vec<u8>,
    value: Vec<u8>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

fn read_messages(path: &str) -> Vec<Message> {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let mut at = 0usize;
    let u32_at = |at: &mut usize| {
        let v = u32::from_le_bytes(data[*at..*at + 4].try_into().unwrap());
        *at += 4;
        v
    };
    let mut out = Vec::new();
    while at < data.len() {
        let n = u32_at(&mut at) as usize;
        let key = data[at..at + n].to_vec();
        at += n;
        let n = u32_at(&mut at) as usize;
        let value = data[at..at + n].to_vec();
        at += n;
        let count = u32_at(&mut at);
        let mut headers = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let n = u32_at(&mut at) as usize;
            let name = String::from_utf8(data[at..at + n].to_vec()).expect("a header name is UTF-8");
            at += n;
            let n = u32_at(&mut at);
            let value = if n == u32::MAX {
                None
            } else {
                let v = data[at..at + n as usize].to_vec();
                at += n as usize;
                Some(v)
            };
            headers.push((name, value));
        }
        out.push(Message { key, value, headers });
    }
    out
}

fn headers_of(m: &Message) -> OwnedHeaders {
    m.headers
        .iter()
        .fold(OwnedHeaders::new_with_capacity(m.headers.len()), |h, (k, v)| h.insert(Header { key: k, value: v.as_deref() }))
}

fn config(servers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", servers)
        .set("client.id", "bench-bare-producer")
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("partitioner", "murmur2_random")
        // The relay's are its publish_timeout (5 s by default) for at most a batch in flight; here
        // the whole file is, so a longer bound (it only decides when a message counts as failed).
        .set("message.timeout.ms", "60000")
        .set("socket.timeout.ms", "60000")
        .set("message.max.bytes", "1000000")
        .set("linger.ms", "1");
    // For a diagnosis only (make bench sets none): more librdkafka settings, `name=value,...`.
    for pair in std::env::var("KAFKA_PRODUCER_SET").unwrap_or_default().split(',').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').expect("KAFKA_PRODUCER_SET is name=value,...");
        c.set(name, value);
    }
    c
}

/// Counts delivery reports. A message whose opaque is not 0 was sent `opaque - 1` ns after
/// `epoch`: its send-to-report time is kept too.
struct Counting {
    ok: AtomicU64,
    failed: AtomicU64,
    epoch: Instant,
    latencies: Mutex<Vec<Duration>>,
}

impl Default for Counting {
    fn default() -> Self {
        Counting { ok: AtomicU64::new(0), failed: AtomicU64::new(0), epoch: Instant::now(), latencies: Mutex::new(Vec::new()) }
    }
}

impl ClientContext for Counting {}

impl ProducerContext for Counting {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, sent: usize) {
        if sent != 0 {
            let latency = self.epoch.elapsed().saturating_sub(Duration::from_nanos(sent as u64 - 1));
            self.latencies.lock().unwrap().push(latency);
        }
        match result {
            Ok(_) => self.ok.fetch_add(1, Ordering::Relaxed),
            Err((e, _)) => {
                if self.failed.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!("delivery failed: {e}");
                }
                1
            }
        };
    }
}

impl Counting {
    fn reported(&self) -> u64 {
        self.ok.load(Ordering::Relaxed) + self.failed.load(Ordering::Relaxed)
    }
}

/// One message on `<topic>-warmup`, acknowledged: the connections and the idempotent producer's
/// id in place before the clock starts. Serves its own report with `poll` (a BaseProducer) or
/// waits for the producer's thread (a ThreadedProducer, `poll` a no-op).
fn warm_up<P: Producer<Counting>>(producer: &P, topic: &str, send: impl FnOnce(BaseRecord<'_, str, [u8], usize>) -> bool, poll: impl Fn()) {
    let warmup = format!("{topic}-warmup");
    producer.client().fetch_metadata(Some(topic), Duration::from_secs(30)).expect("the broker's metadata");
    let record = BaseRecord::with_opaque_to(&warmup, 0).key("warmup").payload(&b"warmup"[..]);
    assert!(send(record), "cannot enqueue the warm-up message");
    let deadline = Instant::now() + Duration::from_secs(30);
    while producer.context().reported() < 1 {
        assert!(Instant::now() < deadline, "no delivery report for the warm-up message after 30 s");
        poll();
    }
    assert_eq!(producer.context().failed.load(Ordering::Relaxed), 0, "the warm-up message failed");
    producer.context().ok.store(0, Ordering::Relaxed);
}

fn base(servers: &str, topic: &str, messages: &[Message]) -> (Duration, Duration) {
    let t = Instant::now();
    let producer: BaseProducer<Counting> = config(servers).create_with_context(Counting::default()).expect("a producer");
    warm_up(&producer, topic, |r| producer.send(r).is_ok(), || {
        producer.poll(Duration::from_millis(1));
    });
    let connect = t.elapsed();
    let t = Instant::now();
    for m in messages {
        let mut record = BaseRecord::with_opaque_to(topic, 0).key(&m.key[..]).payload(&m.value[..]).headers(headers_of(m));
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    producer.poll(Duration::from_millis(1));
                }
                Err((e, _)) => panic!("cannot enqueue a message: {e}"),
            }
        }
        producer.poll(Duration::ZERO);
    }
    let n = messages.len() as u64;
    let ctx = producer.context();
    let deadline = Instant::now() + Duration::from_secs(300);
    while ctx.reported() < n {
        assert!(Instant::now() < deadline, "delivery reports still missing after 300 s");
        // Not 1 ms: polling in 1 ms slices cost this producer 40 % of its rate against tansu (the
        // broker idle a third of the time), 5 ms and longer none; the relay's FutureProducer
        // polls on its own thread in 100 ms slices.
        producer.poll(Duration::from_millis(10));
    }
    let produce = t.elapsed();
    let failed = ctx.failed.load(Ordering::Relaxed);
    assert_eq!(failed, 0, "{failed} of {n} messages failed");
    (connect, produce)
}

fn future(servers: &str, topic: &str, messages: &[Message]) -> (Duration, Duration) {
    let t = Instant::now();
    let producer: FutureProducer = config(servers).create().expect("a producer");
    producer.client().fetch_metadata(Some(topic), Duration::from_secs(30)).expect("the broker's metadata");
    let warmup = format!("{topic}-warmup");
    let report = producer.send_result(FutureRecord::to(&warmup).key("warmup").payload(&b"warmup"[..]));
    let report = futures::executor::block_on(report.map_err(|(e, _)| e).expect("the warm-up message enqueued"));
    assert!(matches!(report, Ok(Ok(_))), "the warm-up message failed: {report:?}");
    let connect = t.elapsed();
    let t = Instant::now();
    let mut pending = Vec::with_capacity(messages.len());
    for m in messages {
        let mut record = FutureRecord::to(topic).key(&m.key).payload(&m.value).headers(headers_of(m));
        loop {
            match producer.send_result(record) {
                Ok(delivery) => break pending.push(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err((e, _)) => panic!("cannot enqueue a message: {e}"),
            }
        }
    }
    let reports = futures::executor::block_on(futures::future::join_all(pending));
    let produce = t.elapsed();
    let failed = reports.iter().filter(|r| !matches!(r, Ok(Ok(_)))).count();
    assert_eq!(failed, 0, "{failed} of {} messages failed", messages.len());
    (connect, produce)
}

fn paced(servers: &str, topic: &str, messages: &[Message], rate: f64, count: usize) -> (Duration, Duration) {
    let t = Instant::now();
    let producer: ThreadedProducer<Counting> = config(servers).create_with_context(Counting::default()).expect("a producer");
    warm_up(&producer, topic, |r| producer.send(r).is_ok(), || std::thread::sleep(Duration::from_millis(1)));
    producer.context().latencies.lock().unwrap().clear();
    let connect = t.elapsed();
    let t = Instant::now();
    for (i, m) in messages.iter().cycle().take(count).enumerate() {
        let due = t + Duration::from_secs_f64(i as f64 / rate);
        // Sleep, never spin: the broker and the relay's machine share the cores.
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let sent = producer.context().epoch.elapsed().as_nanos() as usize + 1;
        let record = BaseRecord::with_opaque_to(topic, sent)
            .key(&m.key[..])
            .payload(&m.value[..])
            .headers(headers_of(m));
        if let Err((e, _)) = producer.send(record) {
            panic!("cannot enqueue a message: {e}");
        }
    }
    let n = count as u64;
    let deadline = Instant::now() + Duration::from_secs(300);
    while producer.context().reported() < n {
        assert!(Instant::now() < deadline, "delivery reports still missing after 300 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    let produce = t.elapsed();
    let failed = producer.context().failed.load(Ordering::Relaxed);
    assert_eq!(failed, 0, "{failed} of {n} messages failed");
    let mut ms: Vec<f64> = producer.context().latencies.lock().unwrap().iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    let pick = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
    print!("p50_ms {:.3} p95_ms {:.3} p99_ms {:.3} max_ms {:.3} ", pick(0.5), pick(0.95), pick(0.99), ms[ms.len() - 1]);
    (connect, produce)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: kafka_producer <host:port> <topic> <messages file> [base | future | paced <messages/s> [count]]");
        std::process::exit(2);
    }
    let messages = read_messages(&args[3]);
    let (servers, topic) = (&args[1], &args[2]);
    let (sent, (connect, produce)) = match args.get(4).map(String::as_str).unwrap_or("base") {
        "base" => (messages.len(), base(servers, topic, &messages)),
        "future" => (messages.len(), future(servers, topic, &messages)),
        "paced" => {
            let rate = args.get(5).and_then(|r| r.parse().ok()).expect("paced <messages/s>");
            let count = args.get(6).map_or(messages.len(), |n| n.parse().expect("paced <messages/s> <count>"));
            (count, paced(servers, topic, &messages, rate, count))
        }
        other => panic!("unknown mode {other}"),
    };
    println!(
        "messages {sent} connect_s {:.4} produce_s {:.4} rate {:.0}",
        connect.as_secs_f64(),
        produce.as_secs_f64(),
        sent as f64 / produce.as_secs_f64()
    );
}
