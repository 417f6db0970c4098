//! A small W3C WebDriver client for headless Chromium through `chromedriver`.
//!
//! Only what the World page tests and bench use: start a session, navigate,
//! run scripts, find and click elements, click at a point, screenshots.
//! Requests are plain HTTP/1.1 over a fresh local TCP connection each
//! (chromedriver listens on 127.0.0.1 only), so this needs no HTTP stack.
//!
//! # Invariants
//! - `chromedriver` listens on a port the OS chose (`--port=0`); readiness is
//!   its own "started successfully" line, never a sleep.
//! - Each [`Browser`] has a fresh profile directory and is killed on drop.
//!
//! # Failure
//! A missing `chromedriver` / `chromium` says how to install them; a
//! WebDriver error carries chromedriver's own error and message.

use std::{process::Stdio, time::Duration};

use anyhow::{anyhow, bail, Context};
use serde_json::{json, Value};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    process::{Child, Command},
};

/// What to install when the browser is missing.
pub const INSTALL_HINT: &str =
    "headless browser tests need Debian's chromium and chromium-driver: apt-get install -y chromium chromium-driver";

/// A running chromedriver with one Chromium session.
pub struct Browser {
    port: u16,
    session: String,
    child: Child,
    _profile: tempfile::TempDir,
}

/// A reference to an element of the page (its WebDriver id).
pub struct Element(#[allow(dead_code)] String);

const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Browser {
    /// Starts chromedriver and a headless Chromium of `width` x `height` CSS px.
    pub async fn start(width: u32, height: u32) -> anyhow::Result<Browser> {
        let profile = tempfile::tempdir()?;
        let mut child = Command::new("chromedriver")
            .arg("--port=0")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting chromedriver ({INSTALL_HINT})"))?;
        let mut stdout = child.stdout.take().context("chromedriver stdout")?;
        // Its ready line ("... started successfully on port N.") ends with a
        // period but no newline, so read bytes, not lines.
        let port = tokio::time::timeout(Duration::from_secs(30), async {
            let mut seen = Vec::new();
            let mut buf = [0u8; 1024];
            loop {
                let n = stdout.read(&mut buf).await?;
                if n == 0 {
                    bail!("chromedriver exited before it was ready");
                }
                seen.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&seen);
                if let Some(rest) = text.split("started successfully on port ").nth(1) {
                    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
                    if rest.len() > digits.len() && !digits.is_empty() {
                        return Ok::<u16, anyhow::Error>(digits.parse()?);
                    }
                }
            }
        })
        .await
        .context("chromedriver did not start within 30 s")??;
        // Keep draining its output so it never blocks on a full pipe.
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        });

        let caps = json!({
            "capabilities": { "alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": chromium_binary(),
                    "args": [
                        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync",
                        "--disable-dev-shm-usage", "--hide-scrollbars",
                        format!("--window-size={width},{height}"),
                        format!("--user-data-dir={}", profile.path().display()),
                    ]
                }
            }}
        });
        let res = request(port, "POST", "/session", Some(&caps))
            .await
            .with_context(|| format!("creating a Chromium session ({INSTALL_HINT})"))?;
        let session = res["sessionId"]
            .as_str()
            .ok_or_else(|| anyhow!("no session id in {res}"))?
            .to_owned();
        let browser = Browser {
            port,
            session,
            child,
            _profile: profile,
        };
        // The window size flag sets the outer window; make the viewport exact.
        browser
            .execute("return [window.innerWidth, window.innerHeight]", json!([]))
            .await?;
        Ok(browser)
    }

    async fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        let path = format!("/session/{}{path}", self.session);
        request(self.port, method, &path, body.as_ref()).await
    }

    pub async fn goto(&self, url: &str) -> anyhow::Result<()> {
        self.cmd("POST", "/url", Some(json!({ "url": url })))
            .await?;
        Ok(())
    }

    /// Runs `script` (a function body; `arguments` are `args`) and returns its value.
    pub async fn execute(&self, script: &str, args: Value) -> anyhow::Result<Value> {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({ "script": script, "args": args })),
        )
        .await
    }

    /// Runs `script` whose last argument is a callback it must call with the result.
    pub async fn execute_async(&self, script: &str, args: Value) -> anyhow::Result<Value> {
        self.cmd(
            "POST",
            "/execute/async",
            Some(json!({ "script": script, "args": args })),
        )
        .await
    }

    /// Sets the script timeout (for `execute_async`), in milliseconds.
    pub async fn script_timeout(&self, ms: u64) -> anyhow::Result<()> {
        self.cmd("POST", "/timeouts", Some(json!({ "script": ms })))
            .await?;
        Ok(())
    }

    pub async fn find(&self, css: &str) -> anyhow::Result<Element> {
        let v = self
            .cmd(
                "POST",
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await
            .with_context(|| format!("finding {css}"))?;
        let id = v[ELEMENT_KEY]
            .as_str()
            .ok_or_else(|| anyhow!("no element for {css}: {v}"))?;
        Ok(Element(id.to_owned()))
    }

    /// A real mouse click at viewport point (x, y): move, press, release.
    pub async fn click_at(&self, x: f64, y: f64) -> anyhow::Result<()> {
        self.pointer(x, y, true).await
    }

    /// Moves the mouse to viewport point (x, y) without clicking.
    pub async fn hover_at(&self, x: f64, y: f64) -> anyhow::Result<()> {
        self.pointer(x, y, false).await
    }

    async fn pointer(&self, x: f64, y: f64, click: bool) -> anyhow::Result<()> {
        let mut actions = vec![json!({
            "type": "pointerMove", "duration": 0, "origin": "viewport",
            "x": x.round() as i64, "y": y.round() as i64
        })];
        if click {
            actions.push(json!({ "type": "pointerDown", "button": 0 }));
            actions.push(json!({ "type": "pointerUp", "button": 0 }));
        }
        let body = json!({ "actions": [{
            "type": "pointer", "id": "mouse",
            "parameters": { "pointerType": "mouse" },
            "actions": actions
        }]});
        self.cmd("POST", "/actions", Some(body)).await?;
        self.cmd("DELETE", "/actions", None).await?;
        Ok(())
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self) -> anyhow::Result<Vec<u8>> {
        let v = self.cmd("GET", "/screenshot", None).await?;
        let b64 = v
            .as_str()
            .ok_or_else(|| anyhow!("screenshot was not a string"))?;
        base64_decode(b64)
    }

    /// Ends the session and chromedriver.
    pub async fn close(mut self) -> anyhow::Result<()> {
        let _ = request(
            self.port,
            "DELETE",
            &format!("/session/{}", self.session),
            None,
        )
        .await;
        let _ = self.child.kill().await;
        Ok(())
    }
}

fn chromium_binary() -> String {
    [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .unwrap_or("chromium")
    .to_owned()
}

/// One WebDriver request; returns the response's `value`.
async fn request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> anyhow::Result<Value> {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .context("connecting to chromedriver")?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    let raw = read_response(&mut stream).await?;
    let (status, body) = split_response(&raw)?;
    let v: Value = serde_json::from_slice(&body)
        .with_context(|| format!("chromedriver sent non-JSON ({status}) for {method} {path}"))?;
    if status >= 400 || v["value"]["error"].is_string() {
        bail!(
            "webdriver {method} {path}: {} ({})",
            v["value"]["error"].as_str().unwrap_or("error"),
            v["value"]["message"]
                .as_str()
                .unwrap_or("")
                .lines()
                .next()
                .unwrap_or("")
        );
    }
    Ok(v["value"].clone())
}

/// Reads one HTTP/1.1 response: to its Content-Length when it has one (the
/// server may keep the connection open), else to the end of the stream.
async fn read_response(stream: &mut TcpStream) -> anyhow::Result<Vec<u8>> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            if let Some(length) = length {
                if raw.len() >= end + 4 + length {
                    raw.truncate(end + 4 + length);
                    return Ok(raw);
                }
            }
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(raw);
        }
        raw.extend_from_slice(&buf[..n]);
    }
}

/// Status code and body (de-chunked) of a raw HTTP/1.1 response.
pub fn split_response(raw: &[u8]) -> anyhow::Result<(u16, Vec<u8>)> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("incomplete HTTP response"))?;
    let head = std::str::from_utf8(&raw[..end])?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad status line in {head:?}"))?;
    let body = &raw[end + 4..];
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase().starts_with("transfer-encoding:")
            && l.to_ascii_lowercase().contains("chunked")
    });
    if !chunked {
        return Ok((status, body.to_vec()));
    }
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow!("bad chunk"))?;
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..line_end])?.trim(), 16)?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok((status, out));
        }
        if rest.len() < size + 2 {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

fn base64_decode(s: &str) -> anyhow::Result<Vec<u8>> {
    fn val(c: u8) -> Option<u32> {
        match c {
            b'A'..=b'Z' => Some(u32::from(c - b'A')),
            b'a'..=b'z' => Some(u32::from(c - b'a') + 26),
            b'0'..=b'9' => Some(u32::from(c - b'0') + 52),
            b'+' => Some(62),
            b'/' => Some(63),
            _ => None,
        }
    }
    let clean: Vec<u8> = s
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let mut acc = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            acc |= val(*c).ok_or_else(|| anyhow!("bad base64"))? << (18 - 6 * i);
        }
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Ok(out)
}

/// A plain HTTP GET of `path` on `addr`; returns status, body bytes and time taken.
pub async fn http_get(
    addr: std::net::SocketAddr,
    path: &str,
) -> anyhow::Result<(u16, Vec<u8>, Duration)> {
    let started = std::time::Instant::now();
    let mut stream = TcpStream::connect(addr).await?;
    let head = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await?;
    let raw = read_response(&mut stream).await?;
    let took = started.elapsed();
    let (status, body) = split_response(&raw)?;
    Ok((status, body, took))
}
