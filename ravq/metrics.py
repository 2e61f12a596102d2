"""Every Prometheus metric of ravq, declared in this one module.

A process makes one ``Metrics`` (its own registry, so tests may run several in one interpreter) and
passes it to the parts that count.  Label values are peers (node names), message types, phases and
reasons: small, bounded sets.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
_COMPUTE_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class Metrics:
    """The metrics of one process (a node or a broker)."""

    def __init__(self, node: str = "") -> None:
        self.node = node
        r = self.registry = CollectorRegistry(auto_describe=True)
        hop = ["socket", "peer", "type"]
        # --- every hop, both directions
        self.messages_sent = Counter("ravq_messages_sent_total", "Messages sent", hop, registry=r)
        self.bytes_sent = Counter("ravq_bytes_sent_total", "Bytes sent (all frames)", hop, registry=r)
        self.send_seconds = Histogram("ravq_send_seconds", "Time to hand one message to the socket",
                                      hop, buckets=_LATENCY_BUCKETS, registry=r)
        self.messages_received = Counter("ravq_messages_received_total", "Messages received", hop, registry=r)
        self.bytes_received = Counter("ravq_bytes_received_total", "Bytes received (all frames)", hop,
                                      registry=r)
        self.receive_seconds = Histogram("ravq_receive_seconds",
                                         "Sender timestamp to decoded on receipt (includes clock offset)",
                                         hop, buckets=_LATENCY_BUCKETS, registry=r)
        self.bad_messages = Counter("ravq_bad_messages_total", "Malformed messages dropped",
                                    ["socket", "reason"], registry=r)
        self.auth_failures = Counter("ravq_auth_failures_total", "Connections refused by authentication",
                                     ["socket", "reason"], registry=r)
        self.peer_timeouts = Counter("ravq_peer_timeouts_total", "Waits on a peer that timed out",
                                     ["peer", "what"], registry=r)
        # --- the stage
        self.compute_seconds = Histogram("ravq_stage_compute_seconds", "Stage compute time per phase",
                                         ["phase"], buckets=_COMPUTE_BUCKETS, registry=r)
        self.busy_seconds = Counter("ravq_stage_busy_seconds_total", "Time in forward and backward",
                                    registry=r)
        self.queue_depth = Gauge("ravq_queue_depth", "Work items waiting", ["queue"], registry=r)
        self.inflight = Gauge("ravq_inflight_micro_batches", "Micro-batches between forward and backward",
                              registry=r)
        self.staleness = Histogram("ravq_staleness", "Version at update minus version used by forward",
                                   buckets=_STALENESS_BUCKETS, registry=r)
        self.version = Gauge("ravq_weight_version", "Optimizer steps applied by this stage", registry=r)
        self.samples = Counter("ravq_samples_total", "Samples whose backward this stage finished", registry=r)
        self.loss = Gauge("ravq_loss", "Loss of the latest micro-batch (last stage only)", registry=r)
        self.losses = Counter("ravq_loss_sum_total", "Sum of micro-batch losses (last stage only)", registry=r)
        self.checkpoints = Counter("ravq_checkpoints_total", "Checkpoints written", registry=r)
        self.checkpoint_seconds = Histogram("ravq_checkpoint_seconds", "Time to write one checkpoint",
                                            buckets=_COMPUTE_BUCKETS, registry=r)
        # --- all-reduce
        self.allreduce_rounds = Counter("ravq_allreduce_rounds_total", "Completed averaging rounds", registry=r)
        self.allreduce_seconds = Histogram("ravq_allreduce_seconds", "Time of one averaging round",
                                           buckets=_LATENCY_BUCKETS, registry=r)
        self.allreduce_aborts = Counter("ravq_allreduce_aborts_total", "Averaging rounds aborted",
                                        ["reason"], registry=r)
        self.allreduce_bytes = Counter("ravq_allreduce_bytes_total", "Segment bytes sent in rings",
                                       ["ring"], registry=r)
        # --- broker
        self.broker_nodes = Gauge("ravq_broker_nodes", "Nodes known to the broker", ["state"], registry=r)
        self.broker_seq = Gauge("ravq_broker_sequence", "Sequence number of the latest update", registry=r)
        self.broker_requests = Counter("ravq_broker_requests_total", "Requests answered", ["type"], registry=r)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics over HTTP from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
