"""`ravq status` output: busy is compute only, waiting is shown next to it by reason."""

from __future__ import annotations

from ravq.cli.status import format_status, waiting_text


def test_status_shows_waiting_by_reason_next_to_compute_busy() -> None:
    status = {"seq": 3, "plan": {"clusters": [{"nodes": ["a", "b"]}]},
              "members": {"a": {"state": "up", "stats": {"cluster": 0, "stage": 0, "version": 40, "samples": 1280,
                                                         "busy_fraction": 0.4, "staleness_mean": 1.0, "loss": 2.5,
                                                         "wall_s": 10.0,
                                                         "wait_s": {"averaging": 5.5, "input": 0.3, "credits": 0.01}}},
                          "b": {"state": "up", "stats": {"cluster": 0, "stage": 1, "wall_s": 0.0}}}}
    text = format_status(status)
    row_a = next(line for line in text.splitlines() if line.startswith("a "))
    assert row_a.split()[5] == "0.40" and row_a.endswith("averaging 0.55 input 0.03")  # 0.001 share hidden
    assert "waiting" in text.splitlines()[1]
    assert waiting_text({"wall_s": 0.0}) == "-" and waiting_text({"wall_s": 5.0, "wait_s": {}}) == "-"


def test_status_says_who_is_behind_nat_and_which_links_are_relayed() -> None:
    from ravq.cli.status import format_status

    stats = {"a": {"routes": {"pipeline": {"b": "accept"}, "ring": {}}},
             "b": {"routes": {"pipeline": {"a": "dial", "c": "relay:broker"}, "ring": {"c": "relay:r1"}}},
             "c": {"routes": {"pipeline": {"b": "relay:broker"}, "ring": {"b": "relay:r1"}}}}
    text = format_status({"seq": 1, "plan": {"clusters": [{"nodes": ["a", "b", "c"]}]},
                          "reach": {"a": "reachable", "b": "behind_nat", "c": "behind_nat"},
                          "members": {n: {"state": "up", "phase": "training", "stats": s} for n, s in stats.items()}})
    assert "reachable: a; behind NAT: b, c" in text
    assert "relayed pipeline link b <-> c via broker" in text and "relayed ring link b <-> c via r1" in text
    assert "1 link(s) dialled from behind NAT: pipeline a<->b" in text


def test_status_shows_each_nodes_averaging_group_and_how_many_versions_it_is_behind_the_freshest() -> None:
    stats = {"a": {"cluster": 0, "stage": 0, "version": 50, "averaging_group": [0, 2]},
             "b": {"cluster": 1, "stage": 0, "version": 47, "averaging_group": [1]},
             "c": {"cluster": 2, "stage": 0}}
    text = format_status({"seq": 1, "plan": {"clusters": [{"nodes": ["a"]}, {"nodes": ["b"]}, {"nodes": ["c"]}]},
                          "members": {n: {"state": "up", "stats": s} for n, s in stats.items()}})
    header, *rows = text.splitlines()[1:]
    assert header.split()[-3:] == ["age", "group", "waiting"]
    assert [r.split()[-3:-1] for r in rows] == [["0", "0,2"], ["3", "1"], ["-", "-"]]
