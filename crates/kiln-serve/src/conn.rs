//! The connection loop `kiln serve` runs the [`crate::app`] Router on: hyper's HTTP/1.1
//! server with the bounds `axum::serve` lacks. A request's headers must arrive within
//! [`ConnLimits::header_timeout`]; an idle keep-alive connection is closed after
//! [`ConnLimits::keep_alive`]; at most [`ConnLimits::max_connections`] are open at once,
//! and a connection arriving at the limit sheds the oldest one with no request in flight
//! (slow or idle clients go first, so `/health` and new requests still get in), or, when
//! every connection has a request in flight, is answered 503 and closed. Body reading is
//! bounded inside the app (`--body-timeout`, `--max-body-bytes`).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tower_service::Service;

/// How long connections get to finish their responses once serving stops, before the
/// rest are closed.
pub const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Bounds on the connections a server keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// A request's headers must be complete within this long of the connection opening
    /// or of the previous response ending; otherwise the connection is closed.
    pub header_timeout: Duration,
    /// An idle keep-alive connection is closed after this long; `None` closes every
    /// connection after its first response.
    pub keep_alive: Option<Duration>,
    /// Connections open at once (at least 1).
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_timeout: Duration::from_secs(10),
            keep_alive: Some(Duration::from_secs(5)),
            max_connections: 1024,
        }
    }
}

/// One open connection as the accept loop sees it.
#[derive(Default)]
struct Conn {
    /// Requests in flight: from the headers parsed to the response body dropped.
    busy: AtomicUsize,
    /// Requests taken so far.
    served: AtomicU64,
    /// Told when `busy` changes.
    changed: Notify,
    /// Told when the accept loop sheds this connection.
    shed: Notify,
}

/// Counts a request in flight on its connection until dropped (with the response body).
struct Busy(Arc<Conn>);

impl Busy {
    fn enter(conn: Arc<Conn>) -> Busy {
        conn.busy.fetch_add(1, Ordering::AcqRel);
        conn.served.fetch_add(1, Ordering::AcqRel);
        conn.changed.notify_one();
        Busy(conn)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_one();
    }
}

/// The open connections in the order they were accepted.
#[derive(Default)]
struct Registry {
    open: Mutex<(u64, BTreeMap<u64, Arc<Conn>>)>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, BTreeMap<u64, Arc<Conn>>)> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn len(&self) -> usize {
        self.lock().1.len()
    }

    fn add(&self) -> (u64, Arc<Conn>) {
        let mut open = self.lock();
        open.0 += 1;
        let id = open.0;
        let conn = Arc::new(Conn::default());
        open.1.insert(id, conn.clone());
        (id, conn)
    }

    fn remove(&self, id: u64) {
        self.lock().1.remove(&id);
    }

    /// Closes the oldest connection with no request in flight (still sending its
    /// headers, or idle between requests); false when every one has a request in flight.
    fn shed_oldest_idle(&self) -> bool {
        let mut open = self.lock();
        let victim = open.1.iter().find(|(_, c)| c.busy.load(Ordering::Acquire) == 0).map(|(id, _)| *id);
        match victim.and_then(|id| open.1.remove(&id)) {
            Some(conn) => {
                conn.shed.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting, lets each
/// connection finish its response (closing idle ones at once) for up to [`CLOSE_WAIT`],
/// and returns.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) {
    let registry = Arc::new(Registry::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut last_warning: Option<Instant> = None;
    let mut warn = |message: String| {
        // At most one line a second: a flood of connections must not flood the log.
        if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            tracing::warn!("{message}");
            last_warning = Some(Instant::now());
        }
    };
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            r = listener.accept() => r,
        };
        while tasks.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors (EMFILE, ENFILE) or a connection reset before
                // it was taken: make room and retry shortly rather than spin.
                let shed = registry.shed_oldest_idle();
                warn(format!(
                    "accepting a connection failed: {e}; {}",
                    if shed { "closed the oldest idle connection" } else { "every connection is busy" }
                ));
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if registry.len() >= limits.max_connections.max(1) && !registry.shed_oldest_idle() {
            warn(format!(
                "refusing a connection: all {} connections (--max-connections) have a request in flight",
                limits.max_connections
            ));
            refuse(&stream, limits.max_connections);
            continue;
        }
        // Tokens are small writes that must not wait for an acknowledgement.
        let _ = stream.set_nodelay(true);
        let (id, conn) = registry.add();
        let (app, stop, registry) = (app.clone(), stop_rx.clone(), registry.clone());
        tasks.spawn(async move {
            connection(stream, app, limits, conn, stop).await;
            registry.remove(id);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained =
        tokio::time::timeout(CLOSE_WAIT, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::info!(
            "closing {} connections still open {:?} after serving stopped",
            tasks.len(),
            CLOSE_WAIT
        );
        tasks.abort_all();
    }
}

/// Answers a connection the server has no room for with a 503 in OpenAI's error shape,
/// written once without waiting, and closes it.
fn refuse(stream: &TcpStream, limit: usize) {
    let body = serde_json::json!({"error": {
        "message": format!("the server has {limit} connections open, each with a request in flight (--max-connections): retry later"),
        "type": "service_unavailable", "param": null, "code": "too_many_connections",
    }})
    .to_string();
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(reply.as_bytes());
}

/// Runs one connection until it closes, is shed, idles past the keep-alive limit, or
/// serving stops.
async fn connection(
    stream: TcpStream,
    app: Router,
    limits: ConnLimits,
    conn: Arc<Conn>,
    mut stop: watch::Receiver<bool>,
) {
    let counted = conn.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let busy = Busy::enter(counted.clone());
        let mut app = app.clone();
        async move {
            let response = match app.call(req.map(Body::new)).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            // The request stays in flight until hyper drops the body: after its last
            // byte, or when the client goes away mid-stream.
            Ok::<_, Infallible>(response.map(move |body| {
                Body::new(body.inspect_frame(move |_| {
                    let _in_flight = &busy;
                }))
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(limits.keep_alive.is_some());
    let mut http = std::pin::pin!(builder.serve_connection(TokioIo::new(stream), service));
    let mut closing = false;
    let mut idle_since: Option<(Instant, u64)> = None;
    loop {
        let served = conn.served.load(Ordering::Acquire);
        if conn.busy.load(Ordering::Acquire) > 0 || served == 0 {
            idle_since = None;
        } else if idle_since.is_none_or(|(_, n)| n != served) {
            idle_since = Some((Instant::now(), served));
        }
        let idle_deadline = match (limits.keep_alive, idle_since) {
            (Some(keep), Some((since, _))) if !closing => Some(since + keep),
            _ => None,
        };
        tokio::select! {
            r = http.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection closed: {e}");
                }
                return;
            }
            () = conn.shed.notified() => return,
            _ = stop.changed(), if !closing => {
                closing = true;
                http.as_mut().graceful_shutdown();
            }
            () = conn.changed.notified() => {}
            () = tokio::time::sleep_until(idle_deadline.unwrap_or_else(Instant::now)), if idle_deadline.is_some() => {
                if conn.busy.load(Ordering::Acquire) == 0 && conn.served.load(Ordering::Acquire) == served {
                    closing = true;
                    http.as_mut().graceful_shutdown();
                }
            }
        }
    }
}
