"""Catch-up through real ring sockets: a stage of a cluster with other cut points loads its weights,
buffers and optimizer state from the live holders in another cluster, bit for bit."""

from __future__ import annotations

import asyncio

import pytest
import torch
import zmq

from ravq.average import catchup
from ravq.average.owners import stage_owners
from ravq.config import ClusterPlan, Plan
from ravq.cut.split import build_task_model, candidate_cuts, even_cuts
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions
from ravq.net.transport import Inbox, Outlink
from ravq.net.wire import DecodeLimits, MsgType
from ravq.stage.pipeline import StageWorker
from tests import models_for_tests as skipnet
from tests.pipeline_harness import make_workers, run_workers


def _cuts(stages: int) -> list[str]:
    model = build_task_model(skipnet, 0)
    return even_cuts(candidate_cuts(model, skipnet), stages)


async def _serve(inbox: Inbox, worker: StageWorker, me: str, count: int) -> None:
    """What a holder's ring reader does with a CATCHUP_REQ (``Averager._answer_catchup``)."""
    for _ in range(count):
        identity, msg = await inbox.recv()
        assert msg.type == MsgType.CATCHUP_REQ
        names = catchup.requested_names(msg, worker)
        assert names is not None
        await inbox.reply(identity, catchup.reply_for(me, msg, catchup.stage_tensors(worker, names)), msg.sender)


def test_a_stage_with_other_cuts_catches_up_bit_exactly_from_several_holders(zmq_ctx) -> None:
    trained = make_workers(skipnet, 3, steps=30, max_inflight=2, cluster=0)  # SGD with momentum: state
    run_workers(trained)
    fresh = make_workers(skipnet, 2, steps=30, max_inflight=2, cluster=1, seed=5)  # other cuts, other seed
    plan = Plan(clusters=[ClusterPlan(nodes=["a0", "a1", "a2"], cuts=_cuts(3)),
                          ClusterPlan(nodes=["b0", "b1"], cuts=_cuts(2))])
    owners = stage_owners(lambda: build_task_model(skipnet, 0), skipnet.example_inputs(4), plan)
    metrics, limits, opts = Metrics(), DecodeLimits(), SocketOptions()

    async def main() -> None:
        inboxes = {n: Inbox.bind(zmq_ctx, "tcp://127.0.0.1:*", "ring", metrics, limits, opts)
                   for n in ("a0", "a1", "a2")}
        addrs = {n: i.sock.getsockopt_string(zmq.LAST_ENDPOINT) for n, i in inboxes.items()}
        links = {n: Outlink.connect(zmq_ctx, addrs[n], "ring", n, metrics, limits, opts, identity="b1")
                 for n in inboxes}
        try:
            target = fresh[1]
            names = list({**target.params, **target.buffers})
            by_node = catchup.holders(plan, 1, owners, names)
            assert sorted(by_node) == ["a1", "a2"]  # cut points differ: pieces come from two holders
            serving = [_serve(inboxes[n], trained[int(n[1])], n, 1) for n in by_node]
            fetched, *_ = await asyncio.gather(catchup.fetch(links, "b1", by_node, 10.0), *serving)
            assert catchup.apply_tensors(target, fetched) == len(fetched)
        finally:
            for link in links.values():
                link.close()
            for inbox in inboxes.values():
                inbox.close()

    asyncio.run(main())
    source = {n: t for w in trained for n, t in {**w.params, **w.buffers}.items()}
    source_state = {n: w.optimizer.state[p] for w in trained for n, p in w.params.items()}
    target = fresh[1]
    for name, value in {**target.params, **target.buffers}.items():
        assert torch.equal(value, source[name]), name
        if name in target.params:
            state = target.optimizer.state[target.params[name]]
            assert set(state) == set(source_state[name]) and state, name
            for key, held in state.items():
                assert torch.equal(held, source_state[name][key]), (name, key)


def test_holders_need_a_training_cluster() -> None:
    plan = Plan(clusters=[ClusterPlan(nodes=["a0"]), ClusterPlan(nodes=["b0"])], excluded=[0])
    with pytest.raises(catchup.CatchupError, match="no other cluster"):
        catchup.holders(plan, 1, [{"w": "a0"}, {"w": "b0"}], ["w"])


def test_holders_come_from_the_cluster_the_broker_chose_when_it_trains() -> None:
    plan = Plan(clusters=[ClusterPlan(nodes=[f"{x}0"], cuts=[]) for x in "abc"], excluded=[1])
    owners = [{"w": "a0"}, {"w": "b0"}, {"w": "c0"}]
    assert catchup.holders(plan, 0, owners, ["w"], source=2) == {"c0": ["w"]}
    assert catchup.holders(plan, 0, owners, ["w"], source=1) == {"c0": ["w"]}  # b is out of the rings
    assert catchup.holders(plan, 2, owners, ["w"]) == {"a0": ["w"]}
