//! `GET …/pods/NAME/log`: the seeded pod `default/demo` logs `tick N at TIME` every second since the server
//! started; any other pod has one line saying its container started. Supports `container`, `follow`, `tailLines`,
//! `timestamps`, `sinceSeconds`, `sinceTime`, `limitBytes`, and refuses `previous` as a pod without restarts would.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, header};
use serde_json::Value;
use time::OffsetDateTime;

use crate::body::Body;
use crate::resources::Resource;
use crate::state::Shared;
use crate::status::ApiError;
use crate::target::Target;
use crate::util;

/// At most this many demo ticks are kept (older ones are "rotated away").
const MAX_TICKS: u64 = 10_000;

/// The container a request addresses: the `container` parameter, or the pod's only container.
pub(crate) fn pick_container(pod: &Value, requested: Option<&str>) -> Result<String, ApiError> {
    let pod_name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let names: Vec<&str> = pod["spec"]["containers"]
        .as_array()
        .map(|cs| cs.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    match requested.filter(|c| !c.is_empty()) {
        Some(c) if names.contains(&c) => Ok(c.to_string()),
        Some(c) => Err(ApiError::bad_request(format!(
            "container {c} is not valid for pod {pod_name}"
        ))),
        None if names.len() == 1 => Ok(names[0].to_string()),
        None => Err(ApiError::bad_request(format!(
            "a container name must be specified for pod {pod_name}, choose one of: [{}]",
            names.join(" ")
        ))),
    }
}

struct LogOptions {
    follow: bool,
    tail: Option<usize>,
    timestamps: bool,
    since: Option<OffsetDateTime>,
    limit_bytes: Option<usize>,
}

fn options(query: &[(String, String)]) -> Result<LogOptions, ApiError> {
    let get = |k: &str| {
        query
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    };
    let flag = |k: &str| matches!(get(k), Some("true" | "1"));
    let number = |k: &str| -> Result<Option<i64>, ApiError> {
        get(k)
            .filter(|v| !v.is_empty())
            .map(|v| {
                v.parse::<i64>()
                    .map_err(|_| ApiError::bad_request(format!("{k}: invalid value {v:?}")))
            })
            .transpose()
    };
    let since_seconds = number("sinceSeconds")?;
    let since_time = get("sinceTime").filter(|v| !v.is_empty());
    if since_seconds.is_some() && since_time.is_some() {
        return Err(ApiError::bad_request(
            "at most one of sinceTime or sinceSeconds may be specified",
        ));
    }
    let since = match (since_seconds, since_time) {
        (Some(s), _) if s < 1 => {
            return Err(ApiError::bad_request(
                "sinceSeconds: must be greater than 0",
            ));
        }
        (Some(s), _) => Some(OffsetDateTime::now_utc() - time::Duration::seconds(s)),
        (_, Some(t)) => Some(
            util::parse_timestamp(t)
                .ok_or_else(|| ApiError::bad_request(format!("sinceTime: invalid value {t:?}")))?,
        ),
        _ => None,
    };
    let tail = number("tailLines")?;
    if tail.is_some_and(|t| t < 0) {
        return Err(ApiError::bad_request(
            "tailLines: must be greater than or equal to 0",
        ));
    }
    let limit_bytes = number("limitBytes")?;
    if limit_bytes.is_some_and(|l| l < 1) {
        return Err(ApiError::bad_request("limitBytes: must be greater than 0"));
    }
    Ok(LogOptions {
        follow: flag("follow"),
        tail: tail.map(|t| usize::try_from(t).unwrap_or(usize::MAX)),
        timestamps: flag("timestamps"),
        since,
        limit_bytes: limit_bytes.map(|l| usize::try_from(l).unwrap_or(usize::MAX)),
    })
}

/// The demo pod's tick `n`.
fn tick(shared: &Shared, n: u64) -> (OffsetDateTime, String) {
    let at = shared.started_wall + time::Duration::seconds(i64::try_from(n).unwrap_or(i64::MAX));
    (at, format!("tick {n} at {}", util::timestamp(at)))
}

/// Ticks that have happened so far (the first at server start).
fn ticks_so_far(shared: &Shared) -> u64 {
    shared.started.elapsed().as_secs() + 1
}

fn render(line: &(OffsetDateTime, String), timestamps: bool) -> String {
    if timestamps {
        format!("{} {}\n", util::timestamp_nanos(line.0), line.1)
    } else {
        format!("{}\n", line.1)
    }
}

pub(crate) fn handle(
    shared: &Arc<Shared>,
    t: &Target,
    query: &[(String, String)],
) -> Result<Response<Body>, ApiError> {
    let namespace = t.namespace.clone().unwrap_or_default();
    let name = t.name.clone().unwrap_or_default();
    let pod = shared.store.get(Resource::Pods, &namespace, &name)?;
    let requested = query
        .iter()
        .find(|(k, _)| k == "container")
        .map(|(_, v)| v.as_str());
    let container = pick_container(&pod, requested)?;
    if query
        .iter()
        .any(|(k, v)| k == "previous" && (v == "true" || v == "1"))
    {
        return Err(ApiError::bad_request(format!(
            "previous terminated container \"{container}\" in pod \"{name}\" not found"
        )));
    }
    let opts = options(query)?;
    let uid = pod["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let is_demo = !shared.demo_uid.is_empty() && uid == shared.demo_uid;

    let (mut lines, mut next_tick) = if is_demo {
        let count = ticks_so_far(shared);
        let first = count.saturating_sub(MAX_TICKS);
        (
            (first..count).map(|n| tick(shared, n)).collect::<Vec<_>>(),
            count,
        )
    } else {
        let started = pod["status"]["startTime"]
            .as_str()
            .or(pod["metadata"]["creationTimestamp"].as_str())
            .and_then(util::parse_timestamp)
            .unwrap_or(shared.started_wall);
        let image = pod["spec"]["containers"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == container.as_str()))
            .and_then(|c| c["image"].as_str())
            .unwrap_or_default()
            .to_string();
        (
            vec![(
                started,
                format!("started container {container} (image {image})"),
            )],
            0,
        )
    };
    if let Some(since) = opts.since {
        lines.retain(|(at, _)| *at >= since);
    }
    if let Some(tail) = opts.tail {
        let skip = lines.len().saturating_sub(tail);
        lines.drain(..skip);
    }
    let mut text: String = lines.iter().map(|l| render(l, opts.timestamps)).collect();
    if let Some(limit) = opts.limit_bytes.filter(|l| text.len() >= *l) {
        text = String::from_utf8_lossy(&text.as_bytes()[..limit]).into_owned();
        return Ok(plain(Body::full(text)));
    }
    if !opts.follow {
        return Ok(plain(Body::full(text)));
    }

    let (tx, body) = Body::channel();
    let shared_task = shared.clone();
    shared.tracker.spawn(async move {
        let shared = shared_task;
        let mut budget = opts.limit_bytes.map(|l| l - text.len());
        if !text.is_empty() && tx.send(Bytes::from(text)).await.is_err() {
            return;
        }
        loop {
            // Ends when the client goes away, the server stops, or the pod is deleted (its container "stops").
            let wake = if is_demo {
                tokio::time::Instant::from_std(shared.started + Duration::from_secs(next_tick))
            } else {
                tokio::time::Instant::now() + Duration::from_secs(1)
            };
            tokio::select! {
                _ = shared.shutdown.cancelled() => return,
                _ = tx.closed() => return,
                _ = tokio::time::sleep_until(wake) => {}
            }
            let still_there = shared
                .store
                .get(Resource::Pods, &namespace, &name)
                .is_ok_and(|p| p["metadata"]["uid"].as_str() == Some(uid.as_str()));
            if !still_there {
                return;
            }
            if !is_demo {
                continue;
            }
            let mut chunk = render(&tick(&shared, next_tick), opts.timestamps);
            next_tick += 1;
            if let Some(left) = budget.as_mut() {
                if chunk.len() >= *left {
                    chunk = String::from_utf8_lossy(&chunk.as_bytes()[..*left]).into_owned();
                    let _ = tx.send(Bytes::from(chunk)).await;
                    return;
                }
                *left -= chunk.len();
            }
            if tx.send(Bytes::from(chunk)).await.is_err() {
                return;
            }
        }
    });
    Ok(plain(body))
}

fn plain(body: Body) -> Response<Body> {
    let mut response = Response::new(body);
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn container_choice_follows_kube_rules() {
        let one = json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main"}]}});
        let two = json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        assert_eq!(pick_container(&one, None), Ok("main".into()));
        assert_eq!(pick_container(&two, Some("b")), Ok("b".into()));
        assert_eq!(
            pick_container(&two, None).map_err(|e| e.message),
            Err("a container name must be specified for pod p, choose one of: [a b]".into())
        );
        assert_eq!(
            pick_container(&one, Some("x")).map_err(|e| e.code),
            Err(400)
        );
    }

    #[test]
    fn options_are_checked() {
        let q = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        assert!(options(&q(&[("tailLines", "-1")])).is_err());
        assert!(
            options(&q(&[
                ("sinceSeconds", "5"),
                ("sinceTime", "2026-01-01T00:00:00Z")
            ]))
            .is_err()
        );
        assert!(options(&q(&[("limitBytes", "x")])).is_err());
        let ok = options(&q(&[
            ("follow", "true"),
            ("tailLines", "2"),
            ("timestamps", "true"),
        ]));
        assert!(ok.is_ok_and(|o| o.follow && o.tail == Some(2) && o.timestamps));
    }
}
