"""`ravq scrape-config`: the Prometheus scrape configuration of a topology, never written by hand.

Every process serving metrics (the broker and each node with a ``metrics_port``) becomes a target
labelled with ``node`` (its name in the topology; ``broker`` for the broker) and ``role``.  A node's
cluster and stage are not target labels: they change with the plan, so each node exports them itself
(``ravq_process_info{role,cluster,stage}``) and the dashboards join on it.
"""

from __future__ import annotations

from ravq.config import Topology

HEADER = """\
# Prometheus scrape configuration for {source}, made by
#   ravq scrape-config --topology {source}
# Regenerate it when the topology changes; do not edit the targets by hand.  Check it with
#   promtool check config FILE
global:
  scrape_interval: 5s        # training runs for minutes: scrape often enough to see it move
  evaluation_interval: 5s

scrape_configs:
"""


def _target(host: str, port: int) -> str:
    return f"'[{host}]:{port}'" if ":" in host else f"'{host}:{port}'"


def scrape_config(topology: Topology, source: str) -> str:
    """prometheus.yml text scraping every process of ``topology``."""
    lines = [HEADER.format(source=source).rstrip("\n")]
    b = topology.broker
    brokers = [(b.host, b.metrics_port, "broker")]
    if b.backup is not None:  # the Binary Star pair's other broker (``ravq_broker_active`` says which serves)
        brokers.append((b.backup.host, b.backup.metrics_port, "broker-backup"))
    brokers = [(host, port, name) for host, port, name in brokers if port is not None]
    if brokers:
        lines += ["  - job_name: ravq-broker", "    static_configs:"]
        for host, port, name in brokers:
            assert port is not None
            lines += [f"      - targets: [{_target(host, port)}]",
                      f"        labels: {{role: broker, node: {name}}}"]
        lines.append("")
    nodes = [n for n in topology.nodes if n.metrics_port is not None]
    if nodes:
        lines += ["  - job_name: ravq-node", "    static_configs:",
                  "      # `node` is the node's name in the topology; dashboards group by it"]
        for n in nodes:
            assert n.metrics_port is not None
            lines += [f"      - targets: [{_target(n.host, n.metrics_port)}]",
                      f"        labels: {{role: node, node: {n.name}}}"]
    relays = [r for r in topology.relays if r.metrics_port is not None]
    if relays:
        lines += ["", "  - job_name: ravq-relay", "    static_configs:"]
        for r in relays:
            assert r.metrics_port is not None
            lines += [f"      - targets: [{_target(r.host, r.metrics_port)}]",
                      f"        labels: {{role: relay, node: {r.name}}}"]
    return "\n".join(lines).rstrip() + "\n"
