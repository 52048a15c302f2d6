//! The connection layer in front of actix-http's HTTP/1 dispatcher: what happens to a TCP
//! connection before and around the requests on it.
//!
//! * **A cap on open connections** (`--max-connections`): a connection over it is accepted, told
//!   503 `too_many_connections` (with `Retry-After`) and closed; it is refused, never left waiting
//!   in the kernel's backlog, so a flood cannot starve the file descriptors the server needs.
//! * **Request heads are checked here first**, with `httparse` (the parser actix-http itself
//!   uses) and actix-http's own rules: a garbage request line, TLS or HTTP/2 bytes, a negative,
//!   signed or repeated `Content-Length`, `Transfer-Encoding` other than `chunked` or with a
//!   `Content-Length`, an HTTP/1.1 request without `Host`, more than 96 header lines (431), a head
//!   over 64 KiB (431), a head not finished within `--head-timeout` (408).
//! * **Bodies must keep arriving**: a body has `--body-timeout` seconds plus one second per
//!   `--min-body-rate` bytes it has sent; past that the connection's read side ends and the
//!   handler answers 408 `request_timeout` (see [`ConnShared::body_timed_out`]).
//!
//! Why not plain `actix_web::HttpServer`: its dispatcher answers what it cannot parse, and a slow
//! head, with an EMPTY 400/408/431 body, has no hook to change that, and has no body-read
//! timeout. Rather than rewriting responses on their way out or hand-writing an HTTP server, the
//! connection runs actix-http's `H1Service` (the same dispatcher `HttpServer` runs) over an I/O
//! wrapper, [`Guarded`], that sees every request head before the dispatcher does. When a head is
//! refused, the wrapper hands the dispatcher a small well-formed request in its place, marked
//! with [`REFUSAL_HEADER`], and keeps the refusal in the connection's [`ConnShared`]; the app's
//! middleware answers it with the documented `{error, detail}` JSON through the same path as every
//! other response (request id, logs, `route="unmatched"` metrics, pipelined answers in order).
//! The wrapper also follows bodies (`Content-Length` or chunked framing) to know where the next
//! head starts. What is hand-written is the framing walk and the timers; parsing is httparse's.
//!
//! The layer knows nothing about routes or the engine: it knows bytes, heads and clocks.

use super::error::ApiError;
use actix_web::rt::net::TcpStream;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The header of the stand-in request that carries a refusal to the app (see the module doc).
pub const REFUSAL_HEADER: &str = "x-imajev-connection-refusal";

/// Most header lines in a request head (actix-http's limit; more is 431).
pub const MAX_HEADERS: usize = 96;

/// Largest request head (request line and headers), bytes; more is 431.
pub const MAX_HEAD_BYTES: usize = 64 << 10;

/// How long a closing connection waits for its peer to close after the server's answer: the
/// dispatcher's disconnect timeout, and the most [`Guarded`]'s close drains what the peer still
/// sends.
pub const DISCONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// The connection layer's settings.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Most open connections; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Time from a connection's start (or a later request's first byte) to its head's end.
    pub head_timeout: Duration,
    /// Time a body may take before the rate counts (see `min_body_rate`).
    pub body_timeout: Duration,
    /// Bytes per second a body must average beyond `body_timeout`.
    pub min_body_rate: u64,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: 512,
            head_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(10),
            min_body_rate: 64 << 10,
        }
    }
}

/// What a connection shares with the handlers of its requests (actix's connection data).
pub struct ConnShared {
    /// The refusal the next stand-in request carries.
    refusal: Mutex<Option<ApiError>>,
    /// Set when a body stopped arriving fast enough: the read side was ended for it.
    body_timed_out: AtomicBool,
    /// The socket, for [`ConnShared::peer_reset`].
    fd: std::os::fd::RawFd,
}

impl ConnShared {
    /// The refusal a stand-in request carries (taken once).
    pub fn take_refusal(&self) -> Option<ApiError> {
        self.refusal.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// True once a body on this connection was cut off for arriving too slowly.
    pub fn body_timed_out(&self) -> bool {
        self.body_timed_out.load(Ordering::SeqCst)
    }

    /// True once the peer reset the connection (or the socket failed). A half-close — the peer
    /// shut down its sending side after its request, which HTTP/1.1 allows and proxies do — is
    /// NOT a disconnect: that peer still reads its answer. A peer that closed completely is found
    /// out when its answer cannot be written.
    pub fn peer_reset(&self) -> bool {
        use std::os::fd::FromRawFd;
        // SAFETY: the fd belongs to the connection whose handler calls this; the connection (and
        // its socket) outlives the handler's future, which holds this ConnShared. ManuallyDrop
        // keeps us from closing it.
        let sock = std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(self.fd) });
        let mut b = [0u8; 1];
        match sock.peek(&mut b) {
            Ok(_) => false,
            Err(e) => !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted),
        }
    }
}

/// Counts open connections; dropping the guard (with the connection) gives its place back.
pub struct ConnCounter {
    open: Arc<AtomicUsize>,
}

impl ConnCounter {
    pub fn new() -> Self {
        ConnCounter { open: Arc::new(AtomicUsize::new(0)) }
    }

    fn enter(&self) -> (ConnGuard, usize) {
        let n = self.open.fetch_add(1, Ordering::SeqCst) + 1;
        (ConnGuard { open: self.open.clone() }, n)
    }
}

impl Default for ConnCounter {
    fn default() -> Self {
        Self::new()
    }
}

struct ConnGuard {
    open: Arc<AtomicUsize>,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Where the byte stream of a connection is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Reading a request head (buffered until complete and checked).
    Head,
    /// A `Content-Length` body: this many bytes to go.
    Length(u64),
    /// A chunked body.
    Chunked(Chunk),
    /// A refusal was handed on: every further byte is read and dropped.
    Refused,
    /// The read side was ended (a body timed out, or the peer's EOF was passed on).
    Ended,
    /// Framing this layer does not follow any more (a malformed chunk): bytes pass unchanged and
    /// actix-http's own decoder decides.
    Opaque,
}

/// Where a chunked body is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Chunk {
    Size { size: u64, digits: u8, ext: bool },
    SizeLf { size: u64 },
    Data(u64),
    DataCr,
    DataLf,
    Trailer { line: usize },
    TrailerLf { line: usize },
}

/// A refusal: the stand-in request replaces the head and the refusal waits in [`ConnShared`].
fn stand_in() -> &'static [u8] {
    b"GET /-/refused HTTP/1.1\r\nhost: refused\r\nconnection: close\r\nx-imajev-connection-refusal: 1\r\n\r\n"
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::message(400, "malformed_request", msg)
}

fn head_too_large(msg: impl Into<String>) -> ApiError {
    ApiError::message(431, "headers_too_large", msg)
}

/// 408 `request_timeout` for a head or body that did not arrive in time.
pub fn request_timeout(msg: impl Into<String>) -> ApiError {
    ApiError::message(408, "request_timeout", msg)
}

/// What a refused head is, for bytes httparse cannot read as HTTP/1.x.
fn not_http1(buf: &[u8], e: httparse::Error) -> ApiError {
    if buf.first() == Some(&0x16) {
        bad("this port speaks plain HTTP/1.1, not TLS: use http://, or put a TLS proxy in front")
    } else if buf.starts_with(b"PRI * HTTP/2.0") {
        bad("HTTP/2 is not served on this port: send HTTP/1.1 (with prior knowledge h2c is refused)")
    } else {
        let what = match e {
            httparse::Error::Version => "HTTP version (send HTTP/1.0 or HTTP/1.1)",
            httparse::Error::Token => "request line (send METHOD /path HTTP/1.1)",
            httparse::Error::HeaderName => "a header name",
            httparse::Error::HeaderValue => "a header value",
            httparse::Error::NewLine | httparse::Error::Status => "a line ending (use CRLF)",
            httparse::Error::TooManyHeaders => "header count",
        };
        bad(format!("the request head is not valid HTTP/1.1: bad {what}"))
    }
}

/// How the body after a head is framed.
#[derive(Debug, PartialEq)]
enum Framing {
    None,
    Length(u64),
    Chunked,
}

/// Checks a parsed head against actix-http's rules (which it would answer with an empty 400)
/// and returns its body's framing.
fn check_head(req: &httparse::Request<'_, '_>) -> Result<Framing, ApiError> {
    let path = req.path.unwrap_or("");
    if !(path.starts_with('/') || path == "*" || path.contains("://")) {
        return Err(bad(format!("the request target {path:?} is not a path; send /v1/systemone")));
    }
    if actix_web::http::Method::from_bytes(req.method.unwrap_or("").as_bytes()).is_err() {
        return Err(bad("the request method is not a valid token"));
    }
    if actix_web::http::Uri::try_from(path).is_err() {
        return Err(bad(format!("the request target {path:?} is not a valid URI")));
    }
    let http11 = req.version == Some(1);
    let (mut length, mut te, mut host) = (None::<u64>, None::<&[u8]>, false);
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value).unwrap_or("").trim();
            let n = v
                .parse::<u64>()
                .ok()
                .filter(|_| !v.starts_with('+'))
                .ok_or_else(|| bad(format!("Content-Length {v:?} is not a byte count")))?;
            if length.is_some() {
                return Err(bad("Content-Length is given more than once; send it once"));
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            if te.is_some() {
                return Err(bad("Transfer-Encoding is given more than once; send it once"));
            }
            te = Some(h.value);
        } else if name.eq_ignore_ascii_case("host") {
            if host {
                return Err(bad("Host is given more than once; send it once"));
            }
            host = true;
        }
    }
    if http11 && !host {
        return Err(bad("an HTTP/1.1 request needs a Host header"));
    }
    match te.map(|v| std::str::from_utf8(v).unwrap_or("").trim()) {
        None => Ok(length.map_or(Framing::None, Framing::Length)),
        Some(_) if !http11 => Err(bad("Transfer-Encoding is not allowed in an HTTP/1.0 request")),
        Some(_) if length.is_some() => {
            Err(bad("a request cannot have both Content-Length and Transfer-Encoding; send one"))
        }
        Some(v) if v.eq_ignore_ascii_case("chunked") => Ok(Framing::Chunked),
        Some(v) if v.eq_ignore_ascii_case("identity") => Ok(Framing::None),
        Some(v) => {
            Err(bad(format!("Transfer-Encoding {v:?} is not supported; send chunked or a Content-Length")))
        }
    }
}

/// Parses a buffered head: `Ok(None)` while it is incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<(usize, Framing)>, ApiError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n > MAX_HEAD_BYTES => {
            Err(head_too_large(format!("the request head is {n} bytes; the limit is {MAX_HEAD_BYTES} bytes")))
        }
        Ok(httparse::Status::Complete(n)) => Ok(Some((n, check_head(&req)?))),
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => Err(head_too_large(format!(
            "the request head is over {MAX_HEAD_BYTES} bytes; send fewer or shorter headers"
        ))),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            Err(head_too_large(format!("the request has more than {MAX_HEADERS} header lines; send fewer")))
        }
        Err(e) => Err(not_http1(buf, e)),
    }
}

/// The I/O of one connection as actix-http's dispatcher sees it (see the module doc).
pub struct Guarded {
    io: TcpStream,
    shared: Arc<ConnShared>,
    limits: ConnLimits,
    phase: Phase,
    /// The head being read, and its line count so far.
    head: Vec<u8>,
    head_lines: usize,
    /// Bytes checked and ready for the dispatcher.
    out: Vec<u8>,
    out_pos: usize,
    /// Requests whose heads were handed on.
    requests: u64,
    /// When the current head's or body's clock started, and the body bytes since.
    clock: Option<Instant>,
    body_bytes: u64,
    timer: Pin<Box<Sleep>>,
    /// Set by the first `poll_shutdown`: when its drain gives up on the peer's close.
    closing: Option<Pin<Box<Sleep>>>,
    _guard: ConnGuard,
}

impl Guarded {
    /// Wraps an accepted connection; over the cap, it is refused with 503 at once.
    pub fn new(io: TcpStream, limits: ConnLimits, counter: &ConnCounter) -> Self {
        use std::os::fd::AsRawFd;
        let (guard, open) = counter.enter();
        let shared = Arc::new(ConnShared {
            refusal: Mutex::new(None),
            body_timed_out: AtomicBool::new(false),
            fd: io.as_raw_fd(),
        });
        let now = Instant::now();
        let mut g = Guarded {
            io,
            shared,
            limits,
            phase: Phase::Head,
            head: Vec::new(),
            head_lines: 0,
            out: Vec::new(),
            out_pos: 0,
            requests: 0,
            clock: Some(now),
            body_bytes: 0,
            timer: Box::pin(tokio::time::sleep_until(now + limits.head_timeout)),
            closing: None,
            _guard: guard,
        };
        if open > limits.max_connections {
            tracing::warn!(
                open,
                limit = limits.max_connections,
                "connection refused: too many open connections"
            );
            g.refuse(
                ApiError::message(
                    503,
                    "too_many_connections",
                    format!(
                        "the server has {} connections open, its limit (--max-connections); retry shortly",
                        limits.max_connections
                    ),
                )
                .with_retry_after(Duration::from_secs(1)),
            );
        }
        g
    }

    /// What the connection shares with its handlers.
    pub fn shared(&self) -> Arc<ConnShared> {
        self.shared.clone()
    }

    fn refuse(&mut self, e: ApiError) {
        tracing::info!(status = e.status, "request refused by the connection layer: {}", e.summary());
        *self.shared.refusal.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        self.out.extend_from_slice(stand_in());
        self.head.clear();
        self.phase = Phase::Refused;
        self.clock = None;
    }

    /// When the current clock runs out, if one runs.
    fn deadline(&self) -> Option<Instant> {
        let start = self.clock?;
        match self.phase {
            Phase::Head => Some(start + self.limits.head_timeout),
            Phase::Length(_) | Phase::Chunked(_) => {
                let rate = self.limits.min_body_rate.max(1);
                let earned = Duration::from_secs_f64(self.body_bytes as f64 / rate as f64);
                Some(start + self.limits.body_timeout + earned)
            }
            _ => None,
        }
    }

    /// Takes bytes read from the socket: heads are checked, bodies followed.
    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            match self.phase {
                Phase::Refused => return,
                Phase::Ended => return,
                Phase::Opaque => {
                    self.out.extend_from_slice(data);
                    return;
                }
                Phase::Head => {
                    if self.head.is_empty() && self.requests > 0 {
                        // A later request's clock starts at its first byte.
                        self.clock = Some(Instant::now());
                    }
                    // Look at most one head's worth past what is buffered, so a body or a
                    // pipelined request behind this head is not copied twice.
                    let take = data.len().min(MAX_HEAD_BYTES + 1);
                    let before = self.head.len();
                    self.head.extend_from_slice(&data[..take]);
                    // Parse only when the head may have ended or gone wrong (its first bytes, a
                    // blank line, too many lines or bytes): a head sent a byte at a time must not
                    // cost a parse per byte.
                    let added = &self.head[before.saturating_sub(3)..];
                    self.head_lines += data[..take].iter().filter(|&&b| b == b'\n').count();
                    let check = before == 0
                        || added.windows(2).any(|w| w == b"\n\n")
                        || added.windows(3).any(|w| w == b"\n\r\n")
                        || self.head_lines > MAX_HEADERS + 1
                        || self.head.len() > MAX_HEAD_BYTES;
                    let parsed = if check { parse_head(&self.head) } else { Ok(None) };
                    match parsed {
                        Ok(None) => data = &data[take..],
                        Ok(Some((n, framing))) => {
                            // The head ends inside what was just added.
                            let used = n - before;
                            self.out.extend_from_slice(&self.head[..n]);
                            self.head.clear();
                            self.head_lines = 0;
                            self.requests += 1;
                            data = &data[used..];
                            self.body_bytes = 0;
                            self.clock = Some(Instant::now());
                            self.phase = match framing {
                                Framing::None | Framing::Length(0) => {
                                    self.clock = None;
                                    Phase::Head
                                }
                                Framing::Length(n) => Phase::Length(n),
                                Framing::Chunked => {
                                    Phase::Chunked(Chunk::Size { size: 0, digits: 0, ext: false })
                                }
                            };
                        }
                        Err(e) => {
                            self.refuse(e);
                            return;
                        }
                    }
                }
                Phase::Length(left) => {
                    let n = (data.len() as u64).min(left) as usize;
                    self.out.extend_from_slice(&data[..n]);
                    self.body_bytes += n as u64;
                    data = &data[n..];
                    self.phase =
                        if left == n as u64 { self.body_done() } else { Phase::Length(left - n as u64) };
                }
                Phase::Chunked(Chunk::Data(left)) => {
                    let n = (data.len() as u64).min(left) as usize;
                    self.out.extend_from_slice(&data[..n]);
                    self.body_bytes += n as u64;
                    data = &data[n..];
                    self.phase = Phase::Chunked(if left == n as u64 {
                        Chunk::DataCr
                    } else {
                        Chunk::Data(left - n as u64)
                    });
                }
                Phase::Chunked(c) => {
                    let b = data[0];
                    self.out.push(b);
                    self.body_bytes += 1;
                    data = &data[1..];
                    self.phase = match chunk_step(c, b) {
                        Some(Some(next)) => Phase::Chunked(next),
                        Some(None) => self.body_done(),
                        // A malformed chunk: actix-http's decoder refuses it (the body's reader
                        // gets the error); this layer stops following the stream.
                        None => Phase::Opaque,
                    };
                }
            }
        }
    }

    fn body_done(&mut self) -> Phase {
        self.clock = None;
        Phase::Head
    }
}

/// One byte of chunked framing (outside chunk data): the next state, `Some(None)` at the end of
/// the body, `None` when the framing is malformed.
fn chunk_step(c: Chunk, b: u8) -> Option<Option<Chunk>> {
    Some(Some(match c {
        Chunk::Size { size, digits, ext } => match b {
            b'\r' if digits > 0 => Chunk::SizeLf { size },
            _ if ext => c,
            b';' if digits > 0 => Chunk::Size { size, digits, ext: true },
            b' ' | b'\t' if digits > 0 => Chunk::Size { size, digits, ext: true },
            _ => {
                let d = (b as char).to_digit(16)? as u64;
                if digits >= 15 {
                    return None;
                }
                Chunk::Size { size: size * 16 + d, digits: digits + 1, ext }
            }
        },
        Chunk::SizeLf { size } if b == b'\n' => {
            if size == 0 {
                Chunk::Trailer { line: 0 }
            } else {
                Chunk::Data(size)
            }
        }
        Chunk::DataCr if b == b'\r' => Chunk::DataLf,
        Chunk::DataLf if b == b'\n' => Chunk::Size { size: 0, digits: 0, ext: false },
        Chunk::Trailer { line } if b == b'\r' => Chunk::TrailerLf { line },
        Chunk::Trailer { line } => Chunk::Trailer { line: line + 1 },
        Chunk::TrailerLf { line: 0 } if b == b'\n' => return Some(None),
        Chunk::TrailerLf { .. } if b == b'\n' => Chunk::Trailer { line: 0 },
        _ => return None,
    }))
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.out_pos < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.out_pos);
                buf.put_slice(&this.out[this.out_pos..this.out_pos + n]);
                this.out_pos += n;
                if this.out_pos == this.out.len() {
                    this.out.clear();
                    this.out_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.phase == Phase::Ended {
                return Poll::Ready(Ok(()));
            }
            let mut tmp = [0u8; 16 << 10];
            let mut rb = ReadBuf::new(&mut tmp);
            match Pin::new(&mut this.io).poll_read(cx, &mut rb) {
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    // The peer's EOF (a half-close, or a close): passed on as is; the dispatcher
                    // still answers what it has.
                    this.phase = Phase::Ended;
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Ok(())) => {
                    let filled = rb.filled().to_vec();
                    this.feed(&filled);
                }
                Poll::Pending => {
                    // No clock between requests: actix-http's keep-alive timer closes an idle
                    // connection. The first head's clock runs from the connection's start, a
                    // later head's from its first byte.
                    let Some(deadline) = this.deadline() else { return Poll::Pending };
                    if Instant::now() < deadline {
                        this.timer.as_mut().reset(deadline);
                        if this.timer.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                    }
                    match this.phase {
                        Phase::Head => this.refuse(request_timeout(format!(
                            "the request head did not arrive within {} s",
                            this.limits.head_timeout.as_secs_f64()
                        ))),
                        _ => {
                            tracing::info!(
                                body_bytes = this.body_bytes,
                                "request body too slow: ending the connection's read side"
                            );
                            this.shared.body_timed_out.store(true, Ordering::SeqCst);
                            this.phase = Phase::Ended;
                            this.clock = None;
                        }
                    }
                }
            }
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// Shuts the sending side, then reads and drops what the peer still sends until it closes,
    /// for at most [`DISCONNECT_TIMEOUT`]: closing with unread bytes would reset the connection
    /// and could destroy the answer before the peer reads it. The bound is this layer's own:
    /// actix-http's disconnect timer does not end this wait (it never runs after a
    /// `Connection: close` answer or at shutdown, and after a keep-alive timeout it is re-armed
    /// at every wake-up), so an idle peer that keeps its socket open held the connection — and
    /// a graceful shutdown — for good.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.closing.is_none() {
            std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
            this.closing = Some(Box::pin(tokio::time::sleep(DISCONNECT_TIMEOUT)));
        }
        loop {
            if this.closing.as_mut().is_some_and(|t| t.as_mut().poll(cx).is_ready()) {
                return Poll::Ready(Ok(()));
            }
            let mut tmp = [0u8; 8 << 10];
            let mut rb = ReadBuf::new(&mut tmp);
            match Pin::new(&mut this.io).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// File descriptors the process needs besides its connections (model files, the blocking pools,
/// the listener, logs).
const SPARE_FDS: u64 = 128;

/// Raises the soft limit on open files to the hard one when `max_connections` would not fit
/// under it, and refuses to start when even the hard limit is too low: past the limit, accept()
/// fails and new clients are refused by the kernel with no answer at all.
pub fn raise_fd_limit(max_connections: usize) -> anyhow::Result<()> {
    let need = max_connections as u64 + SPARE_FDS;
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read/write the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Ok(());
    }
    if lim.rlim_cur >= need {
        return Ok(());
    }
    let raised =
        libc::rlimit { rlim_cur: lim.rlim_max.min(need.max(lim.rlim_cur) as _), rlim_max: lim.rlim_max };
    // SAFETY: as above.
    let ok = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0;
    let now = if ok { raised.rlim_cur } else { lim.rlim_cur };
    anyhow::ensure!(
        now >= need,
        "--max-connections {max_connections} needs {need} open files, and this process may open {now} \
         (ulimit -n); lower --max-connections or raise the limit (Docker: --ulimit nofile=...)"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(s: &str) -> Result<Option<(usize, Framing)>, ApiError> {
        parse_head(s.as_bytes())
    }

    #[test]
    fn heads_are_checked_like_actix_http_does() {
        let ok = "POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(head(ok).unwrap(), Some((ok.len() - 5, Framing::Length(5))));
        assert_eq!(head("GET / HTTP/1.1\r\nHost: x\r\n").unwrap(), None, "incomplete");
        let chunked = "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(head(chunked).unwrap().unwrap().1, Framing::Chunked);
        for (h, status) in [
            ("GET / HTTP/1.1\r\n\r\n", 400),
            ("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
            ("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +1\r\n\r\n", 400),
            ("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", 400),
            ("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
            ("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
            ("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
            ("\x16\x03\x01\x02\x00\x01\x00\x01\x7c\x03\x03", 400),
            ("GARBAGE\x01 LINE\r\n\r\n", 400),
        ] {
            let e = head(h).expect_err(h);
            assert_eq!(e.status, status, "{h:?}: {e}");
            assert!(!e.summary().is_empty());
        }
        let many = format!("GET / HTTP/1.1\r\nHost: x\r\n{}\r\n", "A: b\r\n".repeat(MAX_HEADERS));
        assert_eq!(head(&many).unwrap_err().status, 431);
        let long = format!("GET / HTTP/1.1\r\nHost: x\r\nA: {}", "b".repeat(MAX_HEAD_BYTES));
        assert_eq!(head(&long).unwrap_err().status, 431);
    }

    #[test]
    fn chunked_framing_is_followed_to_its_end() {
        let body = b"5\r\nhello\r\n3;ext=1\r\nabc\r\n0\r\nTrailer: x\r\n\r\n";
        let mut c = Chunk::Size { size: 0, digits: 0, ext: false };
        let mut i = 0;
        let end = loop {
            if let Chunk::Data(n) = c {
                i += n as usize;
                c = Chunk::DataCr;
                continue;
            }
            match chunk_step(c, body[i]).expect("valid framing") {
                Some(next) => c = next,
                None => break i + 1,
            }
            i += 1;
        };
        assert_eq!(end, body.len());
        assert_eq!(chunk_step(Chunk::Size { size: 0, digits: 0, ext: false }, b'z'), None);
    }
}
