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
//! * **Cap:** at most [`ConnectionLimits::max_connections`] are open. At the cap, a new
//!   connection closes the one that has been silent longest (if it has been silent at least
//!   [`EVICTABLE_AFTER`]), so a flood of idle connections cannot lock anyone out; if every
//!   connection is busy, the new one is closed instead.

use std::collections::VecDeque;
use std::io;
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
    /// A connection with no bytes either way for this long is closed.
    pub idle: Duration,
}

impl ConnectionLimits {
    /// The default cap for a process allowed `nofile` descriptors: all but an eighth (at least
    /// [`RESERVED_DESCRIPTORS`]), so the cap is reached before `accept` fails for want of one.
    pub fn max_connections_for(nofile: u64) -> usize {
        let reserve = (nofile / 8).max(RESERVED_DESCRIPTORS);
        nofile.saturating_sub(reserve).max(1) as usize
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
    A: axum_server::accept::Accept<GuardedStream, S> + Clone + Send + 'static,
    A::Future: Send,
    S: Send + 'static,
{
    type Stream = A::Stream;
    type Service = A::Service;
    type Future = futures_util::future::BoxFuture<'static, io::Result<(A::Stream, A::Service)>>;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        let admitted = self.registry.admit();
        let (inner, registry) = (self.inner.clone(), self.registry.clone());
        Box::pin(async move {
            let conn = admitted?;
            let stream = GuardedStream::new(stream, conn, registry);
            inner.accept(stream, service).await
        })
    }
}

/// The open connections, oldest first.
struct Registry {
    limits: ConnectionLimits,
    epoch: Instant,
    open: Mutex<VecDeque<Weak<Conn>>>,
    count: AtomicUsize,
}

/// One connection's shared state: when it last moved a byte, and whether it was told to close.
struct Conn {
    /// Milliseconds since the registry's epoch; 0 until the first byte.
    last_active_ms: AtomicU64,
    evicted: AtomicBool,
    waker: AtomicWaker,
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

    /// Registers a new connection, making room at the cap by closing the longest-silent one.
    fn admit(&self) -> io::Result<Arc<Conn>> {
        let mut open = self.open.lock().expect("connection registry poisoned");
        let count = self.count.load(Ordering::Acquire);
        // Closed connections leave dead entries; sweep them once they outnumber the live ones
        // (amortized O(1) per connection).
        if open.len() > 2 * count + 64 {
            open.retain(|c| c.strong_count() > 0);
        }
        if count >= self.limits.max_connections {
            let now = self.now_ms();
            let silent_since = |c: &Conn| c.last_active_ms.load(Ordering::Relaxed);
            let victim = open
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|c| !c.evicted.load(Ordering::Relaxed))
                .filter(|c| {
                    now.saturating_sub(silent_since(c)) >= EVICTABLE_AFTER.as_millis() as u64
                })
                .min_by_key(|c| silent_since(c));
            match victim {
                Some(victim) => {
                    victim.evicted.store(true, Ordering::Release);
                    victim.waker.wake();
                    tracing::debug!("connection cap reached; closed the longest-silent connection");
                }
                None => {
                    tracing::warn!(
                        max = self.limits.max_connections,
                        "connection cap reached with every connection busy; refused one"
                    );
                    return Err(io::Error::other("connection cap reached"));
                }
            }
        }
        self.count.fetch_add(1, Ordering::AcqRel);
        let conn = Arc::new(Conn {
            last_active_ms: AtomicU64::new(self.now_ms()),
            evicted: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        });
        open.push_back(Arc::downgrade(&conn));
        Ok(conn)
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

    /// Fails the read when the connection was evicted or its silence outlasted its deadline.
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
        let due = self.registry.epoch + Duration::from_millis(last) + allowed;
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
        self.registry.count.fetch_sub(1, Ordering::AcqRel);
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

impl AsyncWrite for GuardedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if me.conn.evicted.load(Ordering::Acquire) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room",
            )));
        }
        let written = ready!(Pin::new(&mut me.inner).poll_write(cx, data))?;
        if written > 0 {
            me.touch();
        }
        Poll::Ready(Ok(written))
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

    /// A connection's deadlines run from its own opening and its own last byte, however long
    /// the server has been up (they once ran from the server's start, so every connection
    /// opened later than the first-byte timeout was closed at its first wait for data); and
    /// one that then goes quiet is closed as timed out.
    #[tokio::test]
    async fn deadlines_run_from_each_connections_own_bytes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let ms = Duration::from_millis;
        let limits = ConnectionLimits { max_connections: 4, first_byte: ms(400), idle: ms(400) };
        let registry = Arc::new(Registry::new(limits));
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
        let conn = registry.admit().unwrap();
        let mut guarded = GuardedStream::new(server, conn, registry.clone());
        let mut byte = [0u8; 1];
        for want in [b'x', b'y'] {
            guarded.read_exact(&mut byte).await.unwrap();
            assert_eq!(byte[0], want);
        }
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
        client.abort();
    }

    /// At the cap, a new connection closes the one silent longest (at least EVICTABLE_AFTER),
    /// and is refused when every open one moved a byte more recently.
    #[tokio::test]
    async fn at_the_cap_the_longest_silent_connection_makes_room() {
        let limits = ConnectionLimits {
            max_connections: 2,
            first_byte: Duration::from_secs(60),
            idle: Duration::from_secs(60),
        };
        let registry = Registry::new(limits);
        let (old, newer) = (registry.admit().unwrap(), registry.admit().unwrap());
        assert!(registry.admit().is_err(), "both are too recent to close");
        tokio::time::sleep(EVICTABLE_AFTER + Duration::from_millis(100)).await;
        newer.last_active_ms.store(registry.now_ms(), Ordering::Relaxed);
        let third = registry.admit().unwrap();
        assert!(old.evicted.load(Ordering::Acquire), "the longest silent made room");
        assert!(!newer.evicted.load(Ordering::Acquire) && !third.evicted.load(Ordering::Acquire));
    }

    #[test]
    fn the_default_cap_leaves_descriptors_for_everything_else() {
        assert_eq!(ConnectionLimits::max_connections_for(2048), 1792);
        assert_eq!(ConnectionLimits::max_connections_for(400), 336);
        assert_eq!(ConnectionLimits::max_connections_for(10), 1);
    }
}
