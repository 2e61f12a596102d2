"""Every Prometheus metric of ravq, declared in this one module.

A process makes one ``Metrics`` (its own registry, so tests may run several in one interpreter) and
passes it to the parts that count.  Label values are peers (node names), message types, phases and
reasons: small, bounded sets.
"""

from __future__ import annotations

import bisect
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

import prometheus_client.metrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
_COMPUTE_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
ABORT_REASONS = ("timeout", "send_timeout", "bad_piece", "base_mismatch", "peer_abort", "peer_moved_on",
                 "skipped", "plan_changed", "finished")
"""Why an averaging round aborts (``ravq.average``): ``ravq_allreduce_aborts_total{reason}`` exists at 0 for
each from the start, so a dashboard's ``increase()`` counts the first abort (a labelled counter born at its
first increment would hide it)."""


def _use_created() -> bool:
    """Whether prometheus_client exports ``_created`` series (PROMETHEUS_DISABLE_CREATED_SERIES)."""
    return getattr(prometheus_client.metrics, "_use_created", True)


class HopCount:
    """One labelled series of a ``HopCounter``."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value, self.created = 0.0, time.time()

    def inc(self, amount: float = 1.0) -> None:
        assert amount >= 0, "counters only go up"
        self.value += amount


class HopObservations:
    """One labelled series of a ``HopHistogram``: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("counts", "created", "sum", "upper_bounds")

    def __init__(self, upper_bounds: Sequence[float]) -> None:
        self.upper_bounds, self.counts = upper_bounds, [0] * len(upper_bounds)
        self.sum, self.created = 0.0, time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.upper_bounds, amount)] += 1
        self.sum += amount


class _HopFamily:
    """A labelled metric counted in plain Python numbers and published when the registry is collected.

    prometheus_client's Counter and Histogram take a lock and check their arguments on every call:
    ~1 us an increment, ~1.5 us an observation, and every message pays five of them.  Here a message
    pays an addition or two.  The exposition is the same as the library's (names, types, labels,
    ``le`` strings, ``_created``).  Counting happens in one thread, the event loop's; a scrape from the
    HTTP thread reads whole numbers under the GIL (a scrape may see a message counted but not yet its
    bytes, as with the library's separate metrics).
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._series: dict[tuple[str, ...], HopCount | HopObservations] = {}
        registry.register(self)

    def _new(self) -> HopCount | HopObservations:
        raise NotImplementedError

    def _labels(self, values: tuple[object, ...], kwargs: dict[str, object]) -> HopCount | HopObservations:
        if kwargs:
            if values or set(kwargs) != set(self.labelnames):
                raise ValueError(f"{self.name}: labels are {self.labelnames}, got {tuple(kwargs)}")
            values = tuple(kwargs[n] for n in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels are {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        if (series := self._series.get(key)) is None:
            series = self._series.setdefault(key, self._new())
        return series

    def _family(self) -> Metric:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError

    def describe(self) -> Iterator[Metric]:
        yield self._family()


class HopCounter(_HopFamily):
    """A Counter (``labels(...).inc(n)``) of messages or bytes per hop."""

    def _new(self) -> HopCount:
        return HopCount()

    def labels(self, *values: object, **kwargs: object) -> HopCount:
        series = self._labels(values, kwargs)
        assert isinstance(series, HopCount)
        return series

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family, created = self._family(), _use_created()
        for key, series in list(self._series.items()):
            assert isinstance(series, HopCount)
            family.add_metric(key, series.value, created=series.created if created else None)
        yield family


class HopHistogram(_HopFamily):
    """A Histogram (``labels(...).observe(s)``) of per-hop times."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._upper_bounds = (*sorted(float(b) for b in buckets), float("inf"))
        self._le = [floatToGoString(b) for b in self._upper_bounds]
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> HopObservations:
        return HopObservations(self._upper_bounds)

    def labels(self, *values: object, **kwargs: object) -> HopObservations:
        series = self._labels(values, kwargs)
        assert isinstance(series, HopObservations)
        return series

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family, created = self._family(), _use_created()
        for key, series in list(self._series.items()):
            assert isinstance(series, HopObservations)
            counts, total, cumulative, buckets = list(series.counts), series.sum, 0, []
            for le, count in zip(self._le, counts):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(key, buckets, total)
            if created:
                family.samples.append(Sample(f"{self.name}_created", dict(zip(self.labelnames, key)),
                                             series.created))
        yield family


class Metrics:
    """The metrics of one process (a node or a broker)."""

    def __init__(self, node: str = "") -> None:
        self.node = node
        r = self.registry = CollectorRegistry(auto_describe=True)
        hop = ["socket", "peer", "type"]
        # --- every hop, both directions (counted by the event loop's thread: see _HopFamily)
        self.messages_sent = HopCounter("ravq_messages_sent_total", "Messages sent", hop, registry=r)
        self.bytes_sent = HopCounter("ravq_bytes_sent_total", "Bytes sent (all frames)", hop, registry=r)
        self.send_seconds = HopHistogram("ravq_send_seconds", "Time to hand one message to the socket",
                                         hop, buckets=_LATENCY_BUCKETS, registry=r)
        self.messages_received = HopCounter("ravq_messages_received_total", "Messages received", hop,
                                            registry=r)
        self.bytes_received = HopCounter("ravq_bytes_received_total", "Bytes received (all frames)", hop,
                                         registry=r)
        self.receive_seconds = HopHistogram("ravq_receive_seconds",
                                            "Sender timestamp to decoded on receipt (includes clock offset)",
                                            hop, buckets=_LATENCY_BUCKETS, registry=r)
        payload = ["socket", "direction", "format"]
        self.payload_wire_bytes = HopCounter(
            "ravq_payload_wire_bytes_total", "Tensor bytes on the wire (compressed: payload and scales), "
            "by compression format (none: plain tensors)", payload, registry=r)
        self.payload_logical_bytes = HopCounter(
            "ravq_payload_logical_bytes_total",
            "Bytes of the uncompressed tensors those wire bytes stand for", payload, registry=r)
        self.bad_messages = Counter("ravq_bad_messages_total", "Malformed messages dropped",
                                    ["socket", "reason"], registry=r)
        self.auth_failures = Counter("ravq_auth_failures_total", "Connections refused by authentication",
                                     ["socket", "reason"], registry=r)
        self.connections_dropped = Counter(
            "ravq_connections_dropped_total",
            "Inbound connections that failed their handshake or closed (peer gone, or dropped by ZeroMQ "
            "for a frame over limits.max_message_bytes)", ["socket", "reason"], registry=r)
        self.peer_timeouts = Counter("ravq_peer_timeouts_total", "Waits on a peer that timed out",
                                     ["peer", "what"], registry=r)
        # --- the stage
        self.compute_seconds = Histogram("ravq_stage_compute_seconds", "Stage compute time per phase",
                                         ["phase"], buckets=_COMPUTE_BUCKETS, registry=r)
        self.busy_seconds = Counter("ravq_stage_busy_seconds_total",
                                    "Time computing forward and backward (waits inside them excluded)",
                                    registry=r)
        self.wait_seconds = Counter("ravq_stage_wait_seconds_total",
                                    "Time the stage waited instead of computing, by reason (input, credits, "
                                    "averaging, checkpoint)", ["reason"], registry=r)
        self.queue_depth = Gauge("ravq_queue_depth", "Work items waiting", ["queue"], registry=r)
        self.inflight = Gauge("ravq_inflight_micro_batches", "Micro-batches between forward and backward",
                              registry=r)
        self.staleness = Histogram("ravq_staleness", "Version at update minus version used by forward",
                                   buckets=_STALENESS_BUCKETS, registry=r)
        self.staleness_updates = Gauge("ravq_staleness_updates", "Mean staleness of the stage's latest 64 "
                                       "backwards in optimizer updates (about micro-batches in flight over "
                                       "micro-batches per update; training.batch)", registry=r)
        self.stale_gradient_cosine = Gauge("ravq_stale_gradient_cosine",
                                           "Asynchrony guard: cosine between a sampled stale gradient and "
                                           "its micro-batch's gradient at the current weights (0: unsampled)",
                                           registry=r)
        self.asynchrony_warning = Gauge("ravq_asynchrony_warning",
                                        "1 once the asynchrony guard found stale and fresh gradients "
                                        "disagreeing (remedy: max_inflight 1 or a larger training.batch)",
                                        registry=r)
        self.version = Gauge("ravq_weight_version", "Optimizer steps applied by this stage", registry=r)
        self.samples = Counter("ravq_samples_total", "Samples whose backward this stage finished",
                               registry=r)
        self.loss = Gauge("ravq_loss", "Loss of the latest micro-batch (last stage only)", registry=r)
        self.losses = Counter("ravq_loss_sum_total", "Sum of micro-batch losses (last stage only)",
                              registry=r)
        self.learning_rate = Gauge("ravq_learning_rate", "Learning rate of the stage's latest optimizer step "
                                   "(first parameter group; training.lr_schedule)", registry=r)
        self.grad_norm = Gauge("ravq_grad_norm", "Global gradient norm of the latest step, before clipping "
                               "(when training.clip_grad_norm or fp16 exchanges norms)", registry=r)
        self.loss_scale = Gauge("ravq_loss_scale", "fp16 dynamic loss scale (last stage only)", registry=r)
        self.train_metric = Gauge("ravq_train_metric", "The task's metrics_fn on training micro-batches, "
                                  "mean of the latest step (last stage only)", ["name"], registry=r)
        self.eval_loss = Gauge("ravq_eval_loss", "Mean loss of the latest evaluation (last stage only)",
                               registry=r)
        self.eval_metric = Gauge("ravq_eval_metric", "The task's metrics_fn, mean of the latest evaluation "
                                 "(last stage only)", ["name"], registry=r)
        self.evaluations = Counter("ravq_evaluations_total", "Evaluations finished (last stage only)",
                                   registry=r)
        self.checkpoints = Counter("ravq_checkpoints_total", "Checkpoints written", registry=r)
        self.checkpoint_seconds = Histogram("ravq_checkpoint_seconds", "Time to write one checkpoint",
                                            buckets=_COMPUTE_BUCKETS, registry=r)
        # --- all-reduce
        self.allreduce_rounds = Counter("ravq_allreduce_rounds_total", "Completed averaging rounds",
                                        registry=r)
        self.averaging_group = Gauge("ravq_averaging_group", "Lowest cluster index of the group this node "
                                     "averaged with in its newest round (global mode: every cluster)",
                                     registry=r)
        self.averaging_group_size = Gauge("ravq_averaging_group_size",
                                          "Clusters in that group (1: alone, the round skipped)", registry=r)
        self.allreduce_seconds = Histogram("ravq_allreduce_seconds", "Time of one averaging round",
                                           buckets=_LATENCY_BUCKETS, registry=r)
        self.allreduce_aborts = Counter("ravq_allreduce_aborts_total", "Averaging rounds aborted",
                                        ["reason"], registry=r)
        for reason in ABORT_REASONS:
            self.allreduce_aborts.labels(reason)
        self.peer_timeouts.labels("pipeline", "give_up")  # the node's one (ravq.swarm.churn)
        self.allreduce_bytes = Counter("ravq_allreduce_bytes_total", "Segment bytes sent in rings",
                                       ["ring"], registry=r)
        self.process_info = Gauge("ravq_process_info", "1: this process's role and, for a node, its cluster "
                                  "and stage in the current plan (dashboards join on it)",
                                  ["role", "cluster", "stage"], registry=r)
        # --- broker
        self.broker_nodes = Gauge("ravq_broker_nodes", "Nodes known to the broker by state: up, lost, done",
                                  ["state"], registry=r)
        self.broker_seq = Gauge("ravq_broker_sequence", "Sequence number of the latest update", registry=r)
        self.broker_member_state = Gauge(
            "ravq_broker_member_state", "1 for the state each node is in as the broker sees it (missing, up, "
            "lost, done): names the node that is down", ["member", "state"], registry=r)
        self.cluster_waiting_for = Gauge(
            "ravq_cluster_waiting_for", "1 for each member a cluster that does not train waits for, and why "
            "(the member's state: lost, missing; or what it does: paused, catching_up, starting...)",
            ["cluster", "member", "why"], registry=r)
        self.broker_requests = Counter("ravq_broker_requests_total", "Requests answered", ["type"],
                                       registry=r)
        self.broker_active = Gauge("ravq_broker_active", "1 while this broker serves the nodes (alone, or "
                                   "the active one of a Binary Star pair), 0 while passive", ["role"],
                                   registry=r)
        self.broker_failovers = Counter("ravq_broker_failovers_total", "Times this broker took over from its "
                                        "pair's other broker (it failed or restarted)", ["role"], registry=r)
        # --- churn
        self.broker_phases = Gauge("ravq_broker_node_phases", "Nodes up, by what they say they do "
                                   "(training, paused, catching_up, standby, ...)", ["phase"], registry=r)
        self.cluster_state = Gauge("ravq_cluster_state", "1 for the state each cluster is in "
                                   "(starting, training, paused, recovering, done)", ["cluster", "state"],
                                   registry=r)
        self.recovery_seconds = Histogram("ravq_recovery_seconds", "Seconds from a cluster's disruption "
                                          "(member lost or restarted) to training again",
                                          buckets=(1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300), registry=r)
        self.node_phase = Gauge("ravq_node_phase", "1 for what this node does now (training, paused, "
                                "catching_up, standby)", ["phase"], registry=r)
        self.pauses = Counter("ravq_pauses_total",
                              "Times this node's cluster paused (a member lost or restarted)", registry=r)
        self.dropped_micro_batches = Counter(
            "ravq_dropped_micro_batches_total",
            "In-flight micro-batches dropped at a pause (stage 0 trains them again)", registry=r)
        self.pause_seconds = Histogram("ravq_pause_seconds",
                                       "Seconds this node's cluster was paused, per pause",
                                       buckets=(1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300), registry=r)
        self.catchup_seconds = Histogram("ravq_catchup_seconds", "Time to load a stage from live peers",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        # NAT traversal (issue #24): reachability, link routes, relays
        self.node_reachable = Gauge("ravq_node_reachable", "1: others can dial this node; 0: behind NAT "
                                    "(measured by the broker's dial-back, or declared)", ["member"],
                                    registry=r)
        self.link_routes = Gauge("ravq_link_route", "Route of this node's link to a peer: 0 direct, 1 the "
                                 "peer dials in, 2 this node dials out, 3 through a relay",
                                 ["socket", "peer"], registry=r)
        self.relayed_bytes = HopCounter("ravq_relayed_bytes_total", "Bytes a relay forwarded, per link",
                                        ["source", "destination"], registry=r)
        self.relayed_messages = HopCounter("ravq_relayed_messages_total",
                                           "Messages a relay forwarded, per link", ["source", "destination"],
                                           registry=r)
        self.relay_dropped = Counter("ravq_relay_dropped_total", "Messages a relay dropped "
                                     "(unknown_destination, unknown_source, queue_full, malformed)",
                                     ["reason"], registry=r)
        self.relay_queued_bytes = Gauge("ravq_relay_queued_bytes", "Bytes a relay holds for one destination",
                                        ["destination"], registry=r)

    def set_role(self, role: str, cluster: int | None = None, stage: int | None = None) -> None:
        """Export ravq_process_info for this process (replacing the previous cluster and stage)."""
        self.process_info.clear()
        self.process_info.labels(role, "" if cluster is None else str(cluster),
                                 "" if stage is None else str(stage)).set(1)

    def total(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples, optionally only those with the given labels."""
        return self.totals({name: (name, labels)})[name]

    def totals(self, queries: dict[str, tuple[str, dict[str, str]]]) -> dict[str, float]:
        """Several ``total``s, key -> (metric name, labels), in one pass over the registry.  A node reports
        seven of them every heartbeat: one collection of every family each took half of its event loop's
        CPU (0.012 cores of a node training alone, twice that on the testbed's quarter-core PCs)."""
        wanted: dict[str, list[tuple[str, dict[str, str]]]] = {}
        for key, (name, labels) in queries.items():
            wanted.setdefault(name, []).append((key, labels))
        sums = dict.fromkeys(queries, 0.0)
        for family in self.registry.collect():
            for sample in family.samples:
                for key, labels in wanted.get(sample.name, ()):
                    if all(sample.labels.get(k) == v for k, v in labels.items()):
                        sums[key] += sample.value
        return sums

    def serve(self, port: int, host: str = "0.0.0.0", listening: socket.socket | None = None) -> None:
        """Serve /metrics over HTTP from a daemon thread: on ``listening``, a socket already bound to
        ``port`` and listening (one the process inherited: ``ravq.net.listen``), or binding the port."""
        if listening is None:
            start_http_server(port, addr=host, registry=self.registry)
            return
        server = _ListeningServer(listening, make_wsgi_app(self.registry))
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No line per scrape on stderr (as prometheus_client's own server)."""


class _ListeningServer(ThreadingWSGIServer):
    """prometheus_client's HTTP server on a socket that is bound and listening already."""

    def __init__(self, sock: socket.socket, app: Any) -> None:
        super().__init__(sock.getsockname()[:2], _QuietHandler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.setup_environ()  # what WSGIServer.server_bind does after binding
        self.set_app(app)
