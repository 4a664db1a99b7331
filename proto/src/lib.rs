//! The Tether tunnel wire protocol, sans-IO.
//!
//! This crate holds the frame format, its codec and the [`Session`] state machine that multiplexes logical
//! streams over one ordered byte transport (WebSocket over TLS today). Like quinn-proto it contains no
//! networking code, no async runtime and no clock: the caller feeds bytes and timestamps in through
//! `handle_*` methods and takes bytes to send, events and the next timeout out through `poll_*` methods.
//!
//! It does not open sockets, does not do TLS, does not know about Kubernetes: streams carry opaque bytes,
//! tagged with a numeric kind chosen by the layer above. The one piece of HTTP here is [`head`], the codec of
//! the binary head blocks that streams of kind [`kind::HTTP_HEADS`] begin with.
//!
//! The wire format is specified in `docs/PROTOCOL.md`.
//!
//! # Driving a session
//!
//! The transport owner loops: feed whatever arrives to [`Session::handle_input`], call
//! [`Session::handle_timeout`] when [`Session::poll_timeout`] is reached, write every chunk
//! [`Session::poll_transmit`] returns (until `None`), and hand [`Session::poll_event`]s to the application.
//! After any application call (`open_stream`, `write`, `read`, ...) there may be new bytes to transmit. Close
//! the transport once [`Session::is_closed`]; tell the session with [`Session::handle_transport_closed`] when
//! the transport ends first.
//!
//! ```
//! use std::time::Instant;
//! use bytes::Bytes;
//! use tether_proto::{Config, Event, Priority, ReadResult, Role, Session, kind};
//!
//! let now = Instant::now();
//! let mut agent = Session::new(Config::new(Role::Client), now);
//! let mut relay = Session::new(Config::new(Role::Server), now);
//! // Stand-in for the transport: move bytes both ways until neither side has anything to send.
//! fn pump(a: &mut Session, b: &mut Session, now: Instant) {
//!     loop {
//!         let mut moved = false;
//!         while let Some(chunk) = a.poll_transmit(now) { b.handle_input(now, chunk); moved = true; }
//!         while let Some(chunk) = b.poll_transmit(now) { a.handle_input(now, chunk); moved = true; }
//!         if !moved { break; }
//!     }
//! }
//!
//! let id = relay.open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new()).unwrap();
//! relay.write(id, b"GET /version HTTP/1.1\r\n\r\n").unwrap();
//! relay.finish(id).unwrap();
//! pump(&mut relay, &mut agent, now);
//!
//! assert_eq!(agent.poll_event(), Some(Event::Connected { version: 1 }));
//! assert!(matches!(agent.poll_event(), Some(Event::StreamOpened { id: opened, .. }) if opened == id));
//! agent.accept_stream(id, Bytes::new()).unwrap();
//! assert_eq!(agent.poll_event(), Some(Event::Readable { id }));
//! let ReadResult::Data(request) = agent.read(now, id, 4096).unwrap() else { panic!() };
//! assert!(request.starts_with(b"GET /version"));
//! assert_eq!(agent.read(now, id, 4096).unwrap(), ReadResult::Finished);
//! ```

mod frame;
pub mod head;
mod session;

pub use frame::{
    DecodeError, FLAG_ACK, FLAG_FIN, Frame, FrameHeader, MAX_FRAME_SIZE_LIMIT, MAX_REASON_LEN,
    MAX_SETTINGS_ENTRIES, MAX_WINDOW, MIN_MAX_FRAME_SIZE, SettingId, Settings,
};
pub use session::{
    Config, ConnectionError, Event, OpenError, Priority, ReadResult, Role, SHED_PERIOD, Session,
    Stats, StreamError, StreamMap, StreamState, TUNE_PERIOD,
};

/// Magic bytes at the start of every HELLO frame ("TTHR").
pub const MAGIC: [u8; 4] = *b"TTHR";

/// The protocol versions this implementation speaks, lowest and highest.
pub const VERSIONS: (u16, u16) = (1, 1);

/// Identifier of a logical stream. 0 is the connection itself; the connection initiator (the agent,
/// [`Role::Client`]) opens odd ids, the acceptor (the relay, [`Role::Server`]) opens even ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u32);

/// Stream kinds known to Tether. The session treats kinds as opaque numbers; these constants are for the
/// layers above so that relay and agent agree.
pub mod kind {
    /// One HTTP/1.1 exchange (request, response, and an upgraded byte stream after a 101) to the apiserver.
    pub const HTTP: u16 = 1;
    /// The long-lived control channel (heartbeat, metadata, identity renewal, ...).
    pub const CONTROL: u16 = 2;
    /// One HTTP exchange whose request and response heads are binary blocks ([`crate::head`]) and whose
    /// bodies are carried as they are: no HTTP/1.1 text on the tunnel. An agent announces that it serves
    /// this kind when it connects; the relay uses [`HTTP`] with agents that do not.
    pub const HTTP_HEADS: u16 = 3;
}

/// Numeric codes carried by REFUSE, RESET and GOAWAY frames.
pub mod code {
    /// No error: graceful close.
    pub const NO_ERROR: u32 = 0;
    /// The peer broke the protocol.
    pub const PROTOCOL_ERROR: u32 = 1;
    /// An internal error in the sender.
    pub const INTERNAL_ERROR: u32 = 2;
    /// The peer sent more than its flow-control credit allowed.
    pub const FLOW_CONTROL_ERROR: u32 = 3;
    /// A frame was larger than the negotiated maximum.
    pub const FRAME_SIZE_ERROR: u32 = 4;
    /// The stream was refused because too many streams are open.
    pub const REFUSED_TOO_MANY_STREAMS: u32 = 5;
    /// The stream kind is not supported by the receiver.
    pub const UNSUPPORTED_KIND: u32 = 6;
    /// The stream's deadline passed before it was accepted.
    pub const TIMEOUT: u32 = 7;
    /// The stream was cancelled by the application.
    pub const CANCEL: u32 = 8;
    /// No protocol version is spoken by both peers.
    pub const VERSION_MISMATCH: u32 = 9;
    /// The peer is generating excessive load (e.g. ping or reset floods).
    pub const ENHANCE_YOUR_CALM: u32 = 10;
    /// The stream was refused by the application (e.g. forbidden); the reason says why.
    pub const REFUSED: u32 = 11;
    /// The connection is shutting down; retry on another connection.
    pub const SHUTDOWN: u32 = 12;
    /// REFUSE only: the receiver is shedding load (its peer opened and cancelled too many streams at once, or
    /// the application is overloaded) and refuses new streams for a moment; the connection stays up and the
    /// stream may be retried shortly on the same connection.
    pub const OVERLOADED: u32 = 13;
}
