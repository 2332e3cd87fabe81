//! Bounds on open connections, below the process's file descriptors: a flood of connections
//! that send nothing (or open HTTP/2 and go quiet) must not take the descriptors every other
//! client, the health probes included, needs.
//!
//! Every accepted TCP connection is wrapped before TLS and HTTP see it ([`GuardedAcceptor`]):
//!
//! * **First byte:** a connection that sends nothing within [`ConnectionLimits::first_byte`] is
//!   closed (HTTP version detection and the TLS handshake would otherwise wait forever).
//! * **Idle:** a connection with no bytes either way for [`ConnectionLimits::idle`] is closed:
//!   HTTP/1 keep-alive and HTTP/2 connections between requests, a peer that stopped reading.
//!   No route holds a request silent that long (the live event stream sends a keep-alive every
//!   15 s).
//! * **Requests, not bytes:** a connection's requests are tracked ([`Tracked`]: from a request's
//!   arrival until its response has been sent). One with no request in flight and none for
//!   [`ConnectionLimits::idle`] is closed however many bytes it moves: HTTP/2 PINGs, SETTINGS
//!   or WINDOW_UPDATEs every half second once kept 400 connections "active" for ever and locked
//!   every honest client out. hyper answers PINGs itself and has no per-frame hook (and under
//!   TLS the bytes are opaque here), so this is what bounds a PING flood: a connection may ping
//!   as it likes, but only while it makes requests.
//! * **Cap:** at most [`ConnectionLimits::max_connections`] are open, and at most
//!   [`ConnectionLimits::max_per_ip`] from one IP address. At a cap, a new connection closes
//!   the one (of all, or of its address) that has gone longest without a request, if it has
//!   none in flight and none for [`EVICTABLE_AFTER`], or has been silent that long; so a flood
//!   of idle or chattering connections cannot lock anyone out. If every connection is busy,
//!   the new one is closed instead.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// A connection silent at least this long may be closed to make room for a new one.
pub const EVICTABLE_AFTER: Duration = Duration::from_secs(1);

/// Descriptors kept back from connections: the store's pool, files, the listener.
const RESERVED_DESCRIPTORS: u64 = 64;

/// How many connections may be open, and how long one may stay silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Open connections at most.
    pub max_connections: usize,
    /// A new connection's first byte must arrive within this.
    pub first_byte: Duration,
    /// A connection with no bytes either way for this long is closed, and so is one with no
    /// request in flight and none for this long.
    pub idle: Duration,
    /// Open connections from one IP address at most (0: no limit of its own; behind a proxy
    /// or load balancer every connection comes from its address).
    pub max_per_ip: usize,
}

impl ConnectionLimits {
    /// The default cap for a process allowed `nofile` descriptors: all but an eighth (at least
    /// [`RESERVED_DESCRIPTORS`]), so the cap is reached before `accept` fails for want of one.
    pub fn max_connections_for(nofile: u64) -> usize {
        let reserve = (nofile / 8).max(RESERVED_DESCRIPTORS);
        nofile.saturating_sub(reserve).max(1) as usize
    }

    /// The default per-address cap: half the connections, so one address cannot take them
    /// all (and no fewer than 16).
    pub fn max_per_ip_for(max_connections: usize) -> usize {
        (max_connections / 2).max(16).min(max_connections)
    }
}

/// Raises the soft limit on open files to the hard limit where the OS allows it; the soft
/// limit in force afterwards (`None` where it cannot be read).
pub fn raise_descriptor_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => Some(limit),
        Err(e) => {
            tracing::warn!(error = %e, "could not raise the open-file limit");
            rlimit::getrlimit(rlimit::Resource::NOFILE).ok().map(|(soft, _)| soft)
        }
    }
}

/// Wraps each accepted connection in a [`GuardedStream`] and then hands it to `inner` (TLS, or
/// nothing).
#[derive(Clone)]
pub struct GuardedAcceptor<A> {
    inner: A,
    registry: Arc<Registry>,
}

impl<A> GuardedAcceptor<A> {
    /// Guards connections with `limits` before `inner` sees them.
    pub fn new(inner: A, limits: ConnectionLimits) -> Self {
        GuardedAcceptor { inner, registry: Arc::new(Registry::new(limits)) }
    }
}

impl<A, S> axum_server::accept::Accept<TcpStream, S> for GuardedAcceptor<A>
where
    A: axum_server::accept::Accept<GuardedStream, Tracked<S>> + Clone + Send + 'static,
    A::Future: Send,
    S: Send + 'static,
{
    type Stream = A::Stream;
    type Service = A::Service;
    type Future = futures_util::future::BoxFuture<'static, io::Result<(A::Stream, A::Service)>>;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        // A peer whose address cannot be read counts as the unspecified one.
        let ip = stream.peer_addr().map_or(IpAddr::from([0, 0, 0, 0]), |a| a.ip());
        let admitted = self.registry.admit(ip);
        let (inner, registry) = (self.inner.clone(), self.registry.clone());
        Box::pin(async move {
            let conn = admitted?;
            let service =
                Tracked { inner: service, conn: conn.clone(), registry: registry.clone() };
            let stream = GuardedStream::new(stream, conn, registry);
            inner.accept(stream, service).await
        })
    }
}

/// The open connections, oldest first, and how many each address holds.
struct Registry {
    limits: ConnectionLimits,
    epoch: Instant,
    open: Mutex<Open>,
    count: AtomicUsize,
}

#[derive(Default)]
struct Open {
    conns: VecDeque<Weak<Conn>>,
    per_ip: HashMap<IpAddr, usize>,
}

/// One connection's shared state: when it last moved a byte and last had a request, how many
/// of its requests are in flight, and whether it was told to close.
struct Conn {
    ip: IpAddr,
    /// Milliseconds since the registry's epoch.
    last_active_ms: AtomicU64,
    /// When a request of it last arrived or was last answered (its opening, before any).
    last_request_ms: AtomicU64,
    in_flight: AtomicUsize,
    evicted: AtomicBool,
    waker: AtomicWaker,
}

impl Conn {
    /// Whether it may be closed to make room at `now`: silent for [`EVICTABLE_AFTER`], or
    /// with no request in flight and none for as long.
    fn evictable(&self, now: u64) -> bool {
        let after = EVICTABLE_AFTER.as_millis() as u64;
        let silent = now.saturating_sub(self.last_active_ms.load(Ordering::Relaxed)) >= after;
        let requestless = self.in_flight.load(Ordering::Acquire) == 0
            && now.saturating_sub(self.last_request_ms.load(Ordering::Relaxed)) >= after;
        !self.evicted.load(Ordering::Relaxed) && (silent || requestless)
    }
}

impl Registry {
    fn new(limits: ConnectionLimits) -> Self {
        Registry {
            limits,
            epoch: Instant::now(),
            open: Mutex::default(),
            count: AtomicUsize::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Registers a new connection from `ip`, making room at a cap (the address's, then the
    /// whole server's) by closing the connection that has gone longest without a request.
    fn admit(&self, ip: IpAddr) -> io::Result<Arc<Conn>> {
        let mut open = self.open.lock().expect("connection registry poisoned");
        let count = self.count.load(Ordering::Acquire);
        // Closed connections leave dead entries; sweep them once they outnumber the live ones
        // (amortized O(1) per connection).
        if open.conns.len() > 2 * count + 64 {
            open.conns.retain(|c| c.strong_count() > 0);
        }
        let from_ip = open.per_ip.get(&ip).copied().unwrap_or(0);
        // One eviction makes room under both caps: an address's connection is also one of all.
        if self.limits.max_per_ip > 0 && from_ip >= self.limits.max_per_ip {
            self.make_room(&open, Some(ip))?;
        } else if count >= self.limits.max_connections {
            self.make_room(&open, None)?;
        }
        self.count.fetch_add(1, Ordering::AcqRel);
        *open.per_ip.entry(ip).or_default() += 1;
        let now = self.now_ms();
        let conn = Arc::new(Conn {
            ip,
            last_active_ms: AtomicU64::new(now),
            last_request_ms: AtomicU64::new(now),
            in_flight: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        });
        open.conns.push_back(Arc::downgrade(&conn));
        Ok(conn)
    }

    /// Closes the evictable connection (of `ip`, or of any address) that has gone longest
    /// without a request; an error when there is none.
    fn make_room(&self, open: &Open, ip: Option<IpAddr>) -> io::Result<()> {
        let now = self.now_ms();
        let victim = open
            .conns
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| ip.is_none_or(|ip| c.ip == ip) && c.evictable(now))
            .min_by_key(|c| c.last_request_ms.load(Ordering::Relaxed));
        match victim {
            Some(victim) => {
                victim.evicted.store(true, Ordering::Release);
                victim.waker.wake();
                tracing::debug!(
                    ?ip,
                    "connection cap reached; closed the longest without a request"
                );
                Ok(())
            }
            None => {
                let (cap, of) = match ip {
                    Some(_) => (self.limits.max_per_ip, "this address's"),
                    None => (self.limits.max_connections, "the"),
                };
                tracing::warn!(
                    ?ip,
                    cap,
                    "{of} connection cap reached with every connection busy; refused one"
                );
                Err(io::Error::other("connection cap reached"))
            }
        }
    }

    /// A connection closed.
    fn closed(&self, conn: &Conn) {
        self.count.fetch_sub(1, Ordering::AcqRel);
        let mut open = self.open.lock().expect("connection registry poisoned");
        if let std::collections::hash_map::Entry::Occupied(mut n) = open.per_ip.entry(conn.ip) {
            *n.get_mut() -= 1;
            if *n.get() == 0 {
                n.remove();
            }
        }
    }
}

/// A connection's service, counting its requests in flight: from a request's arrival until its
/// response's body has been sent (or dropped).
#[derive(Clone)]
pub struct Tracked<S> {
    inner: S,
    conn: Arc<Conn>,
    registry: Arc<Registry>,
}

impl<S, B> tower::Service<axum::http::Request<B>> for Tracked<S>
where
    S: tower::Service<axum::http::Request<B>, Response = axum::response::Response>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = axum::response::Response;
    type Error = S::Error;
    type Future = futures_util::future::BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: axum::http::Request<B>) -> Self::Future {
        let request = InFlight::start(self.conn.clone(), self.registry.clone());
        let answer = self.inner.call(req);
        Box::pin(async move {
            let res = answer.await?;
            Ok(res.map(|body| axum::body::Body::new(SendingBody { body, _request: request })))
        })
    }
}

/// One request in flight on its connection.
struct InFlight {
    conn: Arc<Conn>,
    registry: Arc<Registry>,
}

impl InFlight {
    fn start(conn: Arc<Conn>, registry: Arc<Registry>) -> Self {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        conn.last_request_ms.store(registry.now_ms(), Ordering::Relaxed);
        InFlight { conn, registry }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.conn.last_request_ms.store(self.registry.now_ms(), Ordering::Relaxed);
        self.conn.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body whose request counts as in flight until it is sent or dropped.
struct SendingBody {
    body: axum::body::Body,
    _request: InFlight,
}

impl http_body::Body for SendingBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A TCP connection that closes itself when silent too long or evicted at the cap.
pub struct GuardedStream {
    inner: TcpStream,
    conn: Arc<Conn>,
    registry: Arc<Registry>,
    seen_a_byte: bool,
    deadline: Pin<Box<Sleep>>,
}

impl GuardedStream {
    fn new(inner: TcpStream, conn: Arc<Conn>, registry: Arc<Registry>) -> Self {
        let deadline = Box::pin(tokio::time::sleep(registry.limits.first_byte));
        GuardedStream { inner, conn, registry, seen_a_byte: false, deadline }
    }

    fn touch(&mut self) {
        self.conn.last_active_ms.store(self.registry.now_ms(), Ordering::Relaxed);
    }

    /// When a connection with no request in flight has gone `idle` without one: bytes alone
    /// (PINGs) do not keep it.
    fn requestless_due(&self) -> Option<Instant> {
        (self.seen_a_byte && self.conn.in_flight.load(Ordering::Acquire) == 0).then(|| {
            let last = self.conn.last_request_ms.load(Ordering::Relaxed);
            self.registry.epoch + Duration::from_millis(last) + self.registry.limits.idle
        })
    }

    /// Fails the read when the connection was evicted, its silence outlasted its deadline, or it
    /// has gone too long without a request.
    fn check_alive(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        self.conn.waker.register(cx.waker());
        if self.conn.evicted.load(Ordering::Acquire) {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "closed to make room"));
        }
        // Silent since it opened (admission set its time) or since its last byte.
        let allowed = match self.seen_a_byte {
            false => self.registry.limits.first_byte,
            true => self.registry.limits.idle,
        };
        let last = self.conn.last_active_ms.load(Ordering::Relaxed);
        let silent_due = self.registry.epoch + Duration::from_millis(last) + allowed;
        let due = self.requestless_due().map_or(silent_due, |r| r.min(silent_due));
        if self.deadline.deadline() != due {
            self.deadline.as_mut().reset(due);
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "connection idle too long"));
        }
        Ok(())
    }
}

impl Drop for GuardedStream {
    fn drop(&mut self) {
        self.registry.closed(&self.conn);
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut me.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    me.seen_a_byte = true;
                    me.touch();
                    // Bytes that come with no request (a PING every half second) do not keep a
                    // connection open.
                    if me.requestless_due().is_some_and(|due| due <= Instant::now()) {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no request for too long",
                        )));
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                me.check_alive(cx)?;
                Poll::Pending
            }
        }
    }
}

impl GuardedStream {
    /// One write to the socket, `write` (plain or vectored): refused once the connection was
    /// closed to make room for another; any byte written counts as traffic.
    fn guarded_write(
        &mut self,
        cx: &mut Context<'_>,
        write: impl FnOnce(Pin<&mut TcpStream>, &mut Context<'_>) -> Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        if self.conn.evicted.load(Ordering::Acquire) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room",
            )));
        }
        let written = ready!(write(Pin::new(&mut self.inner), cx))?;
        if written > 0 {
            self.touch();
        }
        Poll::Ready(Ok(written))
    }
}

/// Vectored writes pass through: hyper only queues a response's body (the model cache's shared
/// bytes) instead of copying it when the stream says it writes vectored. Copied, every
/// connection that served a 400 kB model kept a 400 kB write buffer for as long as it stayed
/// open, and a cohort's connections held a model each.
impl AsyncWrite for GuardedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().guarded_write(cx, |socket, cx| socket.poll_write(cx, data))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().guarded_write(cx, |socket, cx| socket.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HERE: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn limits(max_connections: usize, max_per_ip: usize, idle: Duration) -> ConnectionLimits {
        ConnectionLimits { max_connections, first_byte: idle, idle, max_per_ip }
    }

    /// A connection's deadlines run from its own opening and its own last byte, however long
    /// the server has been up (they once ran from the server's start, so every connection
    /// opened later than the first-byte timeout was closed at its first wait for data); and
    /// one that then goes quiet is closed as timed out.
    #[tokio::test]
    async fn deadlines_run_from_each_connections_own_bytes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let ms = Duration::from_millis;
        let registry = Arc::new(Registry::new(limits(4, 0, ms(400))));
        tokio::time::sleep(ms(600)).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            for byte in [b'x', b'y'] {
                tokio::time::sleep(ms(250)).await;
                stream.write_all(&[byte]).await.unwrap();
            }
            tokio::time::sleep(ms(2_000)).await;
        });
        let (server, _) = listener.accept().await.unwrap();
        let conn = registry.admit(HERE).unwrap();
        // The bytes are a request's, in flight until they are read.
        let request = InFlight::start(conn.clone(), registry.clone());
        let mut guarded = GuardedStream::new(server, conn, registry.clone());
        let mut byte = [0u8; 1];
        for want in [b'x', b'y'] {
            guarded.read_exact(&mut byte).await.unwrap();
            assert_eq!(byte[0], want);
        }
        drop(request);
        let quiet = std::time::Instant::now();
        let err = guarded.read_exact(&mut byte).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(quiet.elapsed() >= ms(300) && quiet.elapsed() < ms(1_500), "{:?}", quiet.elapsed());
        drop(guarded);
        assert_eq!(
            registry.count.load(Ordering::Acquire),
            0,
            "a closed connection leaves the count"
        );
        assert!(registry.open.lock().unwrap().per_ip.is_empty(), "and its address's count");
        client.abort();
    }

    /// A connection that keeps sending bytes but makes no request (HTTP/2 PINGs every few
    /// hundred ms once held 400 connections open for ever) is closed once it has gone `idle`
    /// without one.
    #[tokio::test]
    async fn bytes_without_requests_do_not_keep_a_connection_open() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let ms = Duration::from_millis;
        let registry = Arc::new(Registry::new(limits(4, 0, ms(600))));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            for _ in 0..40 {
                if stream.write_all(b"p").await.is_err() {
                    return;
                }
                tokio::time::sleep(ms(100)).await;
            }
        });
        let (server, _) = listener.accept().await.unwrap();
        let conn = registry.admit(HERE).unwrap();
        let mut guarded = GuardedStream::new(server, conn, registry.clone());
        let opened = std::time::Instant::now();
        let mut byte = [0u8; 1];
        let err = loop {
            match guarded.read_exact(&mut byte).await {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        let lasted = opened.elapsed();
        assert!(lasted >= ms(500) && lasted < ms(2_000), "closed after {lasted:?}");
        client.abort();
    }

    /// At the cap, a new connection closes the one longest without a request (silent, or with
    /// no request in flight, for EVICTABLE_AFTER), and is refused when every open one is busy.
    #[tokio::test]
    async fn at_the_cap_the_connection_longest_without_a_request_makes_room() {
        let registry = Arc::new(Registry::new(limits(2, 0, Duration::from_secs(60))));
        let (old, newer) = (registry.admit(HERE).unwrap(), registry.admit(HERE).unwrap());
        assert!(registry.admit(HERE).is_err(), "both are too recent to close");
        tokio::time::sleep(EVICTABLE_AFTER + Duration::from_millis(100)).await;
        // `old` keeps moving bytes (PINGs) but makes no request; `newer` has one in flight.
        old.last_active_ms.store(registry.now_ms(), Ordering::Relaxed);
        let busy = InFlight::start(newer.clone(), registry.clone());
        let third = registry.admit(HERE).unwrap();
        assert!(old.evicted.load(Ordering::Acquire), "chatter without requests made room");
        assert!(!newer.evicted.load(Ordering::Acquire) && !third.evicted.load(Ordering::Acquire));
        drop(busy);
    }

    /// One address may hold at most its cap: at it, its own connection longest without a
    /// request makes room, never another address's; with none evictable it is refused while
    /// other addresses still get in.
    #[tokio::test]
    async fn one_address_cannot_take_more_than_its_cap() {
        let other = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));
        let registry = Arc::new(Registry::new(limits(10, 2, Duration::from_secs(60))));
        let honest = registry.admit(HERE).unwrap();
        let (a, b) = (registry.admit(other).unwrap(), registry.admit(other).unwrap());
        assert!(registry.admit(other).is_err(), "its cap, none evictable yet");
        assert!(registry.admit(HERE).is_ok(), "another address still gets in");
        tokio::time::sleep(EVICTABLE_AFTER + Duration::from_millis(100)).await;
        let _busy = InFlight::start(b.clone(), registry.clone());
        let c = registry.admit(other).unwrap();
        assert!(a.evicted.load(Ordering::Acquire), "its own idle connection made room");
        assert!(!honest.evicted.load(Ordering::Acquire), "not another address's");
        assert!(!b.evicted.load(Ordering::Acquire) && !c.evicted.load(Ordering::Acquire));
    }

    #[test]
    fn the_default_cap_leaves_descriptors_for_everything_else() {
        assert_eq!(ConnectionLimits::max_connections_for(2048), 1792);
        assert_eq!(ConnectionLimits::max_connections_for(400), 336);
        assert_eq!(ConnectionLimits::max_connections_for(10), 1);
        assert_eq!(ConnectionLimits::max_per_ip_for(1792), 896);
        assert_eq!(ConnectionLimits::max_per_ip_for(20), 16);
        assert_eq!(ConnectionLimits::max_per_ip_for(1), 1);
    }
}
