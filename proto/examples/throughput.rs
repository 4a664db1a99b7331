//! Measures how fast two in-memory sessions move bytes (no transport, no I/O): an upper bound on what the
//! protocol layer costs. Run with `cargo run --release -p tether-proto --example throughput`.

use std::time::Instant;

use bytes::Bytes;
use tether_proto::{Config, Event, Priority, ReadResult, Role, Session, StreamId, kind};

fn pump(from: &mut Session, to: &mut Session, now: Instant) -> usize {
    let mut moved = 0;
    while let Some(chunk) = from.poll_transmit(now) {
        moved += chunk.len();
        to.handle_input(now, chunk);
    }
    moved
}

fn run(streams: usize, total: usize) -> anyhow::Result<()> {
    let now = Instant::now();
    let mut client = Session::new(Config::new(Role::Client), now);
    let mut server = Session::new(Config::new(Role::Server), now);
    let ids: Vec<StreamId> = (0..streams)
        .map(|_| client.open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new()))
        .collect::<Result<_, _>>()?;
    pump(&mut client, &mut server, now);
    pump(&mut server, &mut client, now);
    while let Some(e) = server.poll_event() {
        if let Event::StreamOpened { id, .. } = e {
            server.accept_stream(id, Bytes::new())?;
        }
    }
    let block = vec![0x5a; 16 * 1024];
    let per_stream = total / streams;
    let mut written = vec![0; streams];
    let mut read = 0;
    let start = Instant::now();
    while read < per_stream * streams {
        for (i, id) in ids.iter().enumerate() {
            while written[i] < per_stream {
                let n = client.write(*id, &block[..block.len().min(per_stream - written[i])])?;
                if n == 0 {
                    break;
                }
                written[i] += n;
            }
        }
        pump(&mut client, &mut server, now);
        for id in &ids {
            while let ReadResult::Data(d) = server.read(now, *id, usize::MAX)? {
                read += d.len();
            }
        }
        pump(&mut server, &mut client, now);
        while client.poll_event().is_some() {}
        while server.poll_event().is_some() {}
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{streams:>4} streams: {:>6} MiB in {secs:.2} s = {:>7.0} MiB/s ({} frames)",
        total >> 20,
        total as f64 / secs / (1 << 20) as f64,
        client.stats().frames_out
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    for streams in [1, 16, 256] {
        run(streams, 2 << 30)?;
    }
    Ok(())
}
