//! The UDP socket under Tether's quinn endpoints: the kernel's receive batches, handed to quinn one datagram at a
//! time.
//!
//! quinn-udp turns UDP GRO on, so one receive can return up to 64 datagrams of one sender in one buffer, and
//! quinn copies each such buffer into **one** allocation of which every packet's frames keep a slice. A stream
//! whose reader has stopped then pins whole batches rather than its own bytes, and quinn's over-allocation check
//! counts only the bytes: 64 stalled watches grew the relay by up to 242 MiB where their windows allow 64
//! (docs/BENCHMARKS.md, sixteenth and seventeenth passes). Turning GRO off bounds that too, but cost a fifth of
//! a QUIC tunnel's bulk throughput over one stream and over eight, as the kernel then splits every batch the
//! sender's GSO built and hands it over datagram by datagram.
//!
//! [`OneByOne`] keeps GRO and splits the batches itself: it receives into a buffer of its own and copies each
//! datagram into a slot of quinn's, telling quinn it takes one datagram per slot. quinn then gives every
//! datagram an allocation of its own size. The cost is one more copy of each received byte and an allocation per
//! datagram rather than per batch: 9 % of one stream's bulk throughput, none over eight streams or on small GETs.
//!
//! Each slot holds a whole GRO batch (64 datagrams, 94 KB), so quinn's 32 slots would be 3 MB per endpoint. The
//! buffer starts with one slot and doubles, up to quinn's `BATCH_SIZE`, after [`GROW_AFTER`] receives in a row
//! filled every slot it had (the endpoint keeps falling behind its socket): an idle agent keeps 94 KB, and a burst
//! (a handshake, a restart's herd) does not make it keep more; a busy endpoint grows to what quinn's own buffer
//! was. Every agent dials with an endpoint of its own, and 10,000 simulated QUIC agents in one load generator
//! held 24 GB with 3 MB each (docs/BENCHMARKS.md, eighteenth pass).

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use quinn::udp::{BATCH_SIZE, RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// A [`AsyncUdpSocket`] that receives the kernel's GRO batches into its own buffer and hands quinn one
/// datagram per slot. Sending, readiness and addresses are the wrapped socket's.
pub(super) struct OneByOne {
    inner: Arc<dyn AsyncUdpSocket>,
    /// Only the endpoint's driver receives, so the lock is never contended.
    batches: Mutex<Batches>,
}

/// Receives in a row that filled every slot before the buffer doubles.
const GROW_AFTER: u8 = 4;

/// What the last receive returned and how much of it quinn has taken.
struct Batches {
    /// `slots` slots of `slot` bytes.
    buf: Vec<u8>,
    slot: usize,
    /// Slots the next receive offers the kernel: 1 to `BATCH_SIZE`.
    slots: usize,
    /// Receives in a row that filled every slot.
    full: u8,
    metas: [RecvMeta; BATCH_SIZE],
    /// Slots filled by the last receive.
    filled: usize,
    /// The slot being handed out, and the offset of its next datagram.
    next: usize,
    offset: usize,
}

impl OneByOne {
    /// Wraps `inner`, whose receives may return GRO batches of up to `inner.max_receive_segments()` datagrams,
    /// for an endpoint with `config`. Its slots are sized as quinn sizes its own.
    pub(super) fn new(inner: Arc<dyn AsyncUdpSocket>, config: &quinn::EndpointConfig) -> Self {
        let slot = inner.max_receive_segments().max(1) * max_udp_payload(config);
        Self {
            inner,
            batches: Mutex::new(Batches::new(slot)),
        }
    }
}

/// The largest UDP payload an endpoint with `config` receives (at most 64 KiB, as quinn caps it): what one slot
/// of quinn's receive buffer holds when it takes one datagram per slot.
fn max_udp_payload(config: &quinn::EndpointConfig) -> usize {
    const CAP: usize = 64 * 1024;
    usize::try_from(config.get_max_udp_payload_size()).map_or(CAP, |max| max.min(CAP))
}

impl Batches {
    /// One slot of `slot` bytes.
    fn new(slot: usize) -> Self {
        Self {
            buf: vec![0; slot],
            slot,
            slots: 1,
            full: 0,
            metas: [RecvMeta::default(); BATCH_SIZE],
            filled: 0,
            next: 0,
            offset: 0,
        }
    }

    /// Called once everything received was handed out, before the next receive: once [`GROW_AFTER`] receives
    /// in a row filled every slot (more kept being queued), doubles the slots, up to `BATCH_SIZE`.
    fn ready_for_receive(&mut self) {
        if self.filled == self.slots {
            self.full = self.full.saturating_add(1);
        } else {
            self.full = 0;
        }
        if self.full >= GROW_AFTER && self.slots < BATCH_SIZE {
            self.slots = (self.slots * 2).min(BATCH_SIZE);
            self.buf.resize(self.slot * self.slots, 0);
            self.full = 0;
        }
        self.filled = 0;
        self.next = 0;
        self.offset = 0;
    }

    /// Copies pending datagrams into `bufs`, one per slot, in the order received; returns how many. A datagram
    /// larger than its slot (longer than the payload this endpoint allows its peers) is dropped, as a network
    /// would.
    fn hand_out(&mut self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta]) -> usize {
        let mut n = 0;
        while n < bufs.len().min(meta.len()) && self.next < self.filled {
            let m = self.metas[self.next];
            let len = m.len;
            if self.offset >= len {
                self.next += 1;
                self.offset = 0;
                continue;
            }
            let stride = if m.stride == 0 { len } else { m.stride };
            let start = self.next * self.slot + self.offset;
            let size = stride.min(len - self.offset);
            self.offset += size;
            let Some(datagram) = self.buf.get(start..start + size) else {
                continue;
            };
            let Some(into) = bufs[n].get_mut(..size) else {
                continue;
            };
            into.copy_from_slice(datagram);
            let mut one = m;
            one.len = size;
            one.stride = size;
            meta[n] = one;
            n += 1;
        }
        n
    }
}

impl AsyncUdpSocket for OneByOne {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut batches = self.batches.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let n = batches.hand_out(bufs, meta);
            if n > 0 {
                return Poll::Ready(Ok(n));
            }
            let batches = &mut *batches;
            batches.ready_for_receive();
            let active = batches.slots;
            let mut slots: [IoSliceMut<'_>; BATCH_SIZE] = {
                let mut chunks = batches.buf.chunks_mut(batches.slot).map(IoSliceMut::new);
                std::array::from_fn(|_| chunks.next().unwrap_or_else(|| IoSliceMut::new(&mut [])))
            };
            // Only the slots the buffer has: an empty one would take a datagram and keep none of it.
            let (Some(slots), Some(metas)) =
                (slots.get_mut(..active), batches.metas.get_mut(..active))
            else {
                return Poll::Ready(Err(io::Error::other("receive slots out of range")));
            };
            match self.inner.poll_recv(cx, slots, metas) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Ok(0)),
                Poll::Ready(Ok(filled)) => batches.filled = filled.min(active),
                other => return other,
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        1
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

impl fmt::Debug for OneByOne {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OneByOne")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use quinn::Runtime;
    use quinn::udp::UdpSocketState;

    use super::*;

    /// A [`OneByOne`] on a loopback socket whose kernel offers GRO, and a sender that can batch with GSO. A
    /// kernel without either fails the test: it would pass without testing anything.
    struct Loopback {
        socket: OneByOne,
        to: SocketAddr,
        tx: std::net::UdpSocket,
        state: UdpSocketState,
    }

    impl Loopback {
        fn new() -> Self {
            let rx = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
            let to = rx.local_addr().expect("address");
            let inner = quinn::TokioRuntime
                .wrap_udp_socket(rx)
                .expect("tokio socket");
            assert!(
                inner.max_receive_segments() > 1,
                "this kernel offers no UDP GRO, so this test cannot tell anything"
            );
            let socket = OneByOne::new(inner, &quinn::EndpointConfig::default());
            let tx = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
            let state = UdpSocketState::new((&tx).into()).expect("quinn-udp state");
            assert!(
                state.max_gso_segments() >= 20,
                "this kernel offers no UDP GSO"
            );
            Self {
                socket,
                to,
                tx,
                state,
            }
        }

        /// Sends `contents` to the socket: one GSO batch of `segment_size` datagrams when given.
        fn send(&self, contents: &[u8], segment_size: Option<usize>) {
            let transmit = Transmit {
                destination: self.to,
                ecn: None,
                contents,
                segment_size,
                src_ip: None,
            };
            self.state.send((&self.tx).into(), &transmit).expect("send");
        }
    }

    /// Receives through `socket` as quinn's endpoint driver does (`BATCH_SIZE` slots of one datagram) until
    /// `count` datagrams have arrived; also says whether the kernel ever returned a GRO batch.
    async fn receive(socket: &OneByOne, count: usize) -> (Vec<Vec<u8>>, bool) {
        let payload = max_udp_payload(&quinn::EndpointConfig::default());
        let mut buf = vec![0; payload * BATCH_SIZE];
        let mut got = Vec::new();
        let mut batched = false;
        while got.len() < count {
            let mut metas = [RecvMeta::default(); BATCH_SIZE];
            let mut slots: Vec<IoSliceMut<'_>> =
                buf.chunks_mut(payload).map(IoSliceMut::new).collect();
            let n = tokio::time::timeout(
                std::time::Duration::from_secs(10),
                poll_fn(|cx| socket.poll_recv(cx, &mut slots, &mut metas)),
            )
            .await
            .expect("the datagrams sent arrive")
            .expect("receive");
            {
                let batches = socket.batches.lock().expect("not poisoned");
                batched |= batches.metas[..batches.filled]
                    .iter()
                    .any(|m| m.len > m.stride);
            }
            for (meta, slot) in metas.iter().zip(&slots).take(n) {
                assert_eq!(meta.stride, meta.len, "one datagram per slot");
                got.push(slot[..meta.len].to_vec());
            }
        }
        (got, batched)
    }

    /// The attack this socket answers: a stalled stream's packets pinned the whole GRO batch they arrived in.
    /// A batch the sender built with GSO reaches quinn as separate datagrams, in order and intact; a datagram
    /// larger than the payload the endpoint allows is dropped without losing the ones around it.
    #[tokio::test]
    async fn a_gro_batch_reaches_quinn_one_datagram_per_slot() {
        let lo = Loopback::new();
        assert_eq!(lo.socket.max_receive_segments(), 1);
        let batch: Vec<u8> = (0..20u8)
            .flat_map(|i| std::iter::repeat_n(i, 1000))
            .collect();
        lo.send(&batch, Some(1000));
        let too_long = max_udp_payload(&quinn::EndpointConfig::default()) + 1;
        lo.send(&vec![0xee; too_long], None);
        lo.send(&[0xaa; 300], None);
        lo.send(&batch[..3000], Some(1000));

        let (got, batched) = receive(&lo.socket, 24).await;
        assert!(batched, "the kernel never returned a GRO batch");
        let mut want: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 1000]).collect();
        want.push(vec![0xaa; 300]);
        want.extend((0..3u8).map(|i| vec![i; 1000]));
        assert_eq!(got.len(), want.len());
        for (i, (got, want)) in got.iter().zip(&want).enumerate() {
            assert!(
                got == want,
                "datagram {i}: {} bytes of {:?}",
                got.len(),
                got.first()
            );
        }
    }

    /// The buffer starts at one slot, doubles after `GROW_AFTER` receives in a row filled all it had, stops at
    /// quinn's `BATCH_SIZE`; a receive that left slots empty (or found nothing) starts the count again.
    #[test]
    fn the_buffer_grows_only_while_receives_keep_filling_it() {
        let mut b = Batches::new(100);
        assert_eq!((b.slots, b.buf.len()), (1, 100));
        b.ready_for_receive();
        assert_eq!(b.slots, 1, "no receive yet");
        let mut seen = vec![b.slots];
        for _ in 0..10 {
            for _ in 0..GROW_AFTER {
                b.filled = b.slots;
                b.ready_for_receive();
            }
            seen.push(b.slots);
            assert_eq!(b.buf.len(), 100 * b.slots);
        }
        let mut want = vec![1];
        while *want.last().unwrap_or(&BATCH_SIZE) < BATCH_SIZE {
            want.push((want[want.len() - 1] * 2).min(BATCH_SIZE));
        }
        want.resize(seen.len(), BATCH_SIZE);
        assert_eq!(seen, want);

        // A burst: full receives, one short of growing, then one that found nothing.
        let mut b = Batches::new(100);
        for _ in 1..GROW_AFTER {
            b.filled = 1;
            b.ready_for_receive();
        }
        b.ready_for_receive();
        b.filled = 1;
        b.ready_for_receive();
        assert_eq!(b.slots, 1, "a burst does not grow the buffer");
    }

    /// Forty GSO batches queued at once: the buffer grows while they are received (1, 2, 4, then 8 slots after
    /// four full receives each), and every datagram reaches quinn in order and intact across the growth.
    #[tokio::test]
    async fn batches_queued_faster_than_received_arrive_whole_while_the_buffer_grows() {
        let lo = Loopback::new();
        let mut want = Vec::new();
        for batch in 0..40u8 {
            let datagrams: Vec<Vec<u8>> = (0..3u8).map(|i| vec![batch ^ (i << 6); 100]).collect();
            lo.send(&datagrams.concat(), Some(100));
            want.extend(datagrams);
        }
        let (got, batched) = receive(&lo.socket, want.len()).await;
        assert!(batched, "the kernel never returned a GRO batch");
        assert!(got == want, "the datagrams arrived changed or out of order");
        let slots = lo.socket.batches.lock().expect("not poisoned").slots;
        assert_eq!(
            slots, 8,
            "4 × (1 + 2 + 4) = 28 full receives grow it three times"
        );
    }
}
