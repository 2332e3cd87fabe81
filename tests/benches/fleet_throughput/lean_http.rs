//! A lean HTTP/1.1 client for the load generator's connections: one plain TCP socket each,
//! a request written whole, an answer read in large reads and a model counted and let go of.
//! The SDK's client (reqwest over hyper) took the generator 7.9 core-seconds for a round of
//! 10 000 f32 model downloads where the raw transfer costs a receiver 0.44; on the same two
//! cores as the coordinator that made the generator the bottleneck. Devices in the field each
//! run the SDK on a machine of their own; the generator only has to play them cheaply.

use std::io::IoSlice;

use anyhow::{Context, bail, ensure};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bytes asked of the kernel per read: an f32 model of 100k parameters in two reads.
const READ_SIZE: usize = 256 * 1024;

/// The most an answer's head may take before it is refused.
const MAX_HEAD: usize = 64 * 1024;

/// The headers an answer's head may carry (the coordinator sends fewer than ten).
const MAX_HEADERS: usize = 32;

/// What to do with an answer's body.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// Keep it (small answers: a task, an acknowledgement, an error).
    Keep,
    /// Count it and let it go (models).
    Discard,
}

/// An answer: its status, its length, and its bytes when kept.
pub struct Answer {
    pub status: u16,
    pub length: u64,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// Status and body, for an error message.
    pub fn describe(&self) -> String {
        format!("{} {}", self.status, String::from_utf8_lossy(&self.body))
    }
}

/// Why an exchange failed: before the server answered anything (on a kept-alive socket the
/// server may have closed it meanwhile, and the request may be sent again on a new one), or
/// after.
enum Failure {
    Unanswered(anyhow::Error),
    Answering(anyhow::Error),
}

/// One keep-alive connection to one server (`http://host:port`), opened on first use and
/// again whenever the server closes it.
pub struct LeanConnection {
    authority: String,
    stream: Option<TcpStream>,
    /// Read buffer: bytes `start..end` are read and not yet consumed.
    buffer: Box<[u8]>,
    start: usize,
    end: usize,
}

impl LeanConnection {
    /// A connection to `base` (`http://host:port`, no path); plain HTTP only.
    pub fn new(base: &str) -> anyhow::Result<Self> {
        let authority = base
            .strip_prefix("http://")
            .with_context(|| format!("the lean client speaks plain http only, not {base}"))?
            .trim_end_matches('/');
        ensure!(!authority.contains('/'), "{base} has a path; give the server's base URL");
        Ok(LeanConnection {
            authority: authority.to_owned(),
            stream: None,
            buffer: vec![0; READ_SIZE].into_boxed_slice(),
            start: 0,
            end: 0,
        })
    }

    /// Sends `method path` with `headers` and `body` (a `content-length` is added) and reads
    /// the answer. A request on a kept-alive socket that the server closed before answering is
    /// sent once more on a fresh one: the server never read it.
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        keep: Body,
    ) -> anyhow::Result<Answer> {
        let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {}\r\n", self.authority);
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
        let reused = self.stream.is_some();
        let outcome = match self.exchange(head.as_bytes(), body, keep).await {
            Err(Failure::Unanswered(_)) if reused => {
                self.stream = None;
                self.exchange(head.as_bytes(), body, keep).await
            }
            outcome => outcome,
        };
        outcome.map_err(|failure| {
            self.stream = None;
            let (Failure::Unanswered(e) | Failure::Answering(e)) = failure;
            e.context(format!("{method} http://{}{path}", self.authority))
        })
    }

    async fn exchange(&mut self, head: &[u8], body: &[u8], keep: Body) -> Result<Answer, Failure> {
        if self.stream.is_none() {
            let stream = TcpStream::connect(&self.authority)
                .await
                .context("connecting")
                .map_err(Failure::Answering)?;
            stream.set_nodelay(true).context("setting TCP_NODELAY").map_err(Failure::Answering)?;
            self.stream = Some(stream);
            (self.start, self.end) = (0, 0);
        }
        let stream = self.stream.as_mut().expect("opened above");
        // Head and body in one vectored write, as the SDK's client sends them.
        let sent = async {
            let mut slices = [IoSlice::new(head), IoSlice::new(body)];
            let mut left = &mut slices[..];
            while !left.is_empty() {
                let wrote = stream.write_vectored(left).await?;
                if wrote == 0 {
                    return Err(std::io::Error::from(std::io::ErrorKind::WriteZero));
                }
                IoSlice::advance_slices(&mut left, wrote);
            }
            Ok(())
        };
        sent.await.context("sending the request").map_err(Failure::Unanswered)?;

        let (status, length, close) = self.read_head().await?;
        let mut answer = Answer { status, length, body: Vec::new() };
        if keep == Body::Keep {
            answer.body.reserve(length as usize);
        }
        let mut left = length;
        while left > 0 {
            if self.start == self.end {
                let want = READ_SIZE.min(usize::try_from(left).unwrap_or(READ_SIZE));
                self.fill(want).await.map_err(Failure::Answering)?;
            }
            let take = (self.end - self.start).min(usize::try_from(left).unwrap_or(usize::MAX));
            if keep == Body::Keep {
                answer.body.extend_from_slice(&self.buffer[self.start..self.start + take]);
            }
            self.start += take;
            left -= take as u64;
        }
        if close {
            self.stream = None;
        }
        Ok(answer)
    }

    /// Reads and parses an answer's head: its status, its `content-length` and whether the
    /// server closes the connection after it.
    async fn read_head(&mut self) -> Result<(u16, u64, bool), Failure> {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut parsed = httparse::Response::new(&mut headers);
            let status = parsed
                .parse(&self.buffer[self.start..self.end])
                .context("parsing the answer's head")
                .map_err(Failure::Answering)?;
            if let httparse::Status::Complete(size) = status {
                let code = parsed.code.unwrap_or(0);
                let (mut length, mut close) = (None, false);
                for header in parsed.headers.iter() {
                    let value = std::str::from_utf8(header.value).unwrap_or("");
                    if header.name.eq_ignore_ascii_case("content-length") {
                        length = value.trim().parse::<u64>().ok();
                    } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
                        return Err(Failure::Answering(anyhow::anyhow!(
                            "an answer sent with transfer-encoding {value}: the lean client \
                             reads only answers of a declared length"
                        )));
                    } else if header.name.eq_ignore_ascii_case("connection") {
                        close = value.eq_ignore_ascii_case("close");
                    }
                }
                self.start += size;
                let length = match length {
                    Some(length) => length,
                    // No body by definition (RFC 9112 §6.3).
                    None if code == 204 || code == 304 || code < 200 => 0,
                    None => {
                        return Err(Failure::Answering(anyhow::anyhow!(
                            "an answer ({code}) without a content-length"
                        )));
                    }
                };
                return Ok((code, length, close));
            }
            if self.end - self.start >= MAX_HEAD {
                return Err(Failure::Answering(anyhow::anyhow!(
                    "an answer's head over {MAX_HEAD} bytes"
                )));
            }
            let nothing_yet = self.start == self.end;
            if let Err(e) = self.fill(READ_SIZE).await {
                return Err(if nothing_yet {
                    Failure::Unanswered(e)
                } else {
                    Failure::Answering(e)
                });
            }
        }
    }

    /// Reads at most `want` more bytes after those buffered (moving them to the front when the
    /// buffer's tail is short); the server closing the connection is an error.
    async fn fill(&mut self, want: usize) -> anyhow::Result<()> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.buffer.len() - self.end < want.min(READ_SIZE / 2) {
            self.buffer.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        let room = (self.buffer.len() - self.end).min(want.max(1));
        let stream = self.stream.as_mut().context("no connection")?;
        let read = stream.read(&mut self.buffer[self.end..self.end + room]).await?;
        if read == 0 {
            bail!("the server closed the connection");
        }
        self.end += read;
        Ok(())
    }
}
