"""Envoy xDS resources built from the control plane's desired state.

Resources are written as plain dicts in Envoy's JSON form (readable, diffable, the same shape as
``/config_dump``) and turned into protobuf only at the gRPC edge (:func:`to_any`).

For every upstream ``X`` (``source``, ``target``) there are two clusters:

* ``X``: the real endpoint, with active health checks on ``/readyz``, consecutive-5xx outlier
  detection and no panic routing (a dead single host must read as dead, not as "route anyway").
  Parity probes reach it directly through a header-matched route (``x-gpumigrate-cluster: X``)
  that exists only on the probe listener (below).
* ``X_failover``: an aggregate cluster ``[X, every other upstream]``. The weighted split points at
  these, so a request whose attempt on ``X`` fails is retried on the next priority (the other
  side) instead of in the same cluster: a weighted split by itself is not failover (NOTES.md).
  Client traffic statistics therefore live under ``cluster.X_failover.*``.

Two route configurations, one per listener of the bootstrap (:mod:`envoy`):

* ``gpumigrate`` (the client listener): internal paths (``/admin`` and below, any case) answer 404
  from Envoy itself, then the weighted split. It has no header routes, so no client header picks a
  side; internal headers are stripped before the request reaches the workload.
* ``gpumigrate-probes`` (a second listener, always on loopback): one route per upstream selected by
  ``x-gpumigrate-cluster``, which tags its answer with ``x-gpumigrate-upstream`` so a prober can
  tell that it reached the side it named; a request naming no side gets 404. A loopback caller can
  reach the upstreams' own ports anyway, so this listener opens nothing that was closed.
"""

from __future__ import annotations

from typing import Any

ROUTE_NAME = "gpumigrate"
PROBE_ROUTE_NAME = "gpumigrate-probes"
PROBE_HEADER = "x-gpumigrate-cluster"  # request: which side a probe asks for (probe listener only)
SIDE_HEADER = "x-gpumigrate-upstream"  # response: which side answered a probe (probe listener only)
INTERNAL_HEADERS = (PROBE_HEADER, SIDE_HEADER)
# Paths a workload serves to its operators, never to clients (the reference server's /admin/fault).
# Matched after Envoy normalised the path (dot segments, slashes, escaped slashes), in any case.
INTERNAL_PATH_PREFIXES = ("/admin",)
FAILOVER_SUFFIX = "_failover"
WEIGHT_SCALE = 100  # percent → integer weight: 1% = 100, so 0.01% steps are exact

# Safe for any request: the request never reached the application (NOTES.md).
SAFE_RETRY_ON = "connect-failure,refused-stream,reset-before-request"
# Only for idempotent APIs (inference: a pure function of the request): a reset mid-request
# (a killed process) or a 5xx is retried on the other side instead of reaching the client.
IDEMPOTENT_RETRY_ON = SAFE_RETRY_ON + ",reset,5xx"

_T = "type.googleapis.com/"
CLUSTER_TYPE = _T + "envoy.config.cluster.v3.Cluster"
ROUTE_TYPE = _T + "envoy.config.route.v3.RouteConfiguration"


def failover_name(upstream: str) -> str:
    return upstream + FAILOVER_SUFFIX


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def endpoint_cluster(
    name: str,
    host: str,
    port: int,
    *,
    health_path: str = "/readyz",
    health_interval_s: float = 0.5,
    health_timeout_s: float = 2.0,
    max_connection_s: float = 30.0,
) -> dict[str, Any]:
    """The real upstream. Health: 2 failed checks (≈1 s when refused) mark it down; 1 good check brings it
    back. A check may take ``health_timeout_s``: a source busy snapshotting on a loaded host answers
    /readyz late, and with one host and no panic routing, "late" read as "dead" is an outage of the
    front door's own making. A dead host refuses at once, so this costs nothing there."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}
                    ]
                }
            ],
        },
        "health_checks": [
            {
                "timeout": _duration(max(health_timeout_s, health_interval_s)),
                "interval": _duration(health_interval_s),
                "no_traffic_interval": _duration(health_interval_s),
                "no_traffic_healthy_interval": _duration(health_interval_s),
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "http_health_check": {"path": health_path},
            }
        ],
        # consecutive-5xx works with one host; the success-rate mode needs ≥ 5 (NOTES.md).
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_gateway_failure": 3,
            "interval": "0.5s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        },
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "circuit_breakers": {
            "thresholds": [
                {"max_connections": 4096, "max_pending_requests": 4096, "max_requests": 4096, "max_retries": 1024}
            ]
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                # Upstream connections are recycled so a restored target is picked up by every worker.
                "common_http_protocol_options": {
                    "max_connection_duration": _duration(max_connection_s),
                    "idle_timeout": "4s",
                },  # < uvicorn's 5 s keep-alive
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
    }


def failover_cluster(name: str, order: list[str]) -> dict[str, Any]:
    """Aggregate cluster: priority 0 is ``order[0]``; retries go down the list."""
    return {
        "name": name,
        "connect_timeout": "0.25s",
        "lb_policy": "CLUSTER_PROVIDED",
        "circuit_breakers": {
            "thresholds": [
                {"max_connections": 4096, "max_pending_requests": 4096, "max_requests": 4096, "max_retries": 1024}
            ]
        },
        "cluster_type": {
            "name": "envoy.clusters.aggregate",
            "typed_config": {"@type": _T + "envoy.extensions.clusters.aggregate.v3.ClusterConfig", "clusters": order},
        },
    }


def retry_policy(idempotent: bool) -> dict[str, Any]:
    return {
        "retry_on": IDEMPOTENT_RETRY_ON if idempotent else SAFE_RETRY_ON,
        "num_retries": 2,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _T + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
            }
        ],
        "host_selection_retry_max_attempts": 3,
        # The retry of an attempt that failed on priority 0 (X) goes to priority 1 (the other side).
        "retry_priority": {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {
                "@type": _T + "envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
                "update_frequency": 1,
            },
        },
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
    }


def _internal_path_routes() -> list[dict[str, Any]]:
    return [
        {
            "name": f"internal{prefix.replace('/', '-')}",
            "match": {"path_separated_prefix": prefix, "case_sensitive": False},
            "direct_response": {"status": 404, "body": {"inline_string": "not found\n"}},
        }
        for prefix in INTERNAL_PATH_PREFIXES
    ]


def route_config(
    upstreams: list[str], weights: dict[str, float], *, idempotent: bool, timeout_s: float = 30.0, failover: bool = True
) -> dict[str, Any]:
    """The client listener's routes: internal paths answer 404, everything else takes the weighted split.

    ``failover=False`` splits over the endpoint clusters directly (a plain weighted split, as most
    canary tools do); it exists as the benchmark's baseline, to show what the failover buys.
    """
    split: list[dict[str, Any]] = [
        {"name": failover_name(u) if failover else u, "weight": int(round(weights.get(u, 0.0) * WEIGHT_SCALE))}
        for u in upstreams
    ]
    split = [c for c in split if c["weight"] > 0]
    routes = _internal_path_routes()
    routes.append(
        {
            "name": "split",
            "match": {"prefix": "/"},
            "route": {
                "weighted_clusters": {"clusters": split},
                "timeout": _duration(timeout_s),
                "retry_policy": retry_policy(idempotent),
            },
        }
    )
    return {
        "name": ROUTE_NAME,
        # A client cannot name a side, and cannot make its answer look like a probe's.
        "request_headers_to_remove": list(INTERNAL_HEADERS),
        "response_headers_to_remove": [SIDE_HEADER],
        "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}],
    }


def probe_route_config(upstreams: list[str], *, timeout_s: float = 30.0) -> dict[str, Any]:
    """The probe listener's routes: ``x-gpumigrate-cluster: X`` reaches ``X`` alone, and says so."""
    routes: list[dict[str, Any]] = [
        {
            "name": f"probe-{u}",
            "match": {"prefix": "/", "headers": [{"name": PROBE_HEADER, "string_match": {"exact": u}}]},
            "route": {"cluster": u, "timeout": _duration(timeout_s)},
            "response_headers_to_add": [
                {"header": {"key": SIDE_HEADER, "value": u}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            ],
        }
        for u in upstreams
    ]
    routes.append(
        {
            "name": "no-side",
            "match": {"prefix": "/"},
            "direct_response": {
                "status": 404,
                "body": {"inline_string": f"probe listener: name an upstream in {PROBE_HEADER}\n"},
            },
        }
    )
    return {
        "name": PROBE_ROUTE_NAME,
        "request_headers_to_remove": [PROBE_HEADER],
        "virtual_hosts": [{"name": "probes", "domains": ["*"], "routes": routes}],
    }


def clusters_for(upstreams: dict[str, tuple[str, int, str]]) -> dict[str, dict[str, Any]]:
    """All clusters for ``{name: (host, port, health_path)}``, keyed by cluster name."""
    out: dict[str, dict[str, Any]] = {}
    names = list(upstreams)
    for name, (host, port, health) in upstreams.items():
        out[name] = endpoint_cluster(name, host, port, health_path=health)
    for name in names:
        out[failover_name(name)] = failover_cluster(failover_name(name), [name] + [n for n in names if n != name])
    return out


def to_any(resource: dict[str, Any], type_url: str) -> Any:
    """Dict (Envoy JSON) → ``google.protobuf.Any`` of ``type_url``. Imports the stubs lazily."""
    from google.protobuf import any_pb2, json_format

    _load_descriptors()
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.config.route.v3 import route_pb2

    msg = cluster_pb2.Cluster() if type_url == CLUSTER_TYPE else route_pb2.RouteConfiguration()
    json_format.ParseDict(resource, msg)
    packed = any_pb2.Any()
    packed.Pack(msg)
    return packed


def _load_descriptors() -> None:
    """Register the extension types named in ``@type`` fields so json_format can resolve them."""
    import envoy.extensions.clusters.aggregate.v3.cluster_pb2  # noqa: F401
    import envoy.extensions.retry.host.previous_hosts.v3.previous_hosts_pb2  # noqa: F401
    import envoy.extensions.retry.priority.previous_priorities.v3.previous_priorities_config_pb2  # noqa: F401
    import envoy.extensions.upstreams.http.v3.http_protocol_options_pb2  # noqa: F401
