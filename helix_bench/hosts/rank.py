"""One bench rank on an emulated host (``helix bench --hosts``): ``rank_main`` with its result
written to a JSON file instead of a multiprocessing queue (the rank runs in another host's
namespaces). Usage: python -m helix_bench.hosts.rank PLAN_JSON RANK OUT"""

from __future__ import annotations

import json
import sys

from helix_bench.ranks import RankPlan, rank_main


class _FileResult:
    def __init__(self, path: str):
        self.path = path

    def put(self, item) -> None:
        kind, rank, payload, extra = item
        with open(self.path, "w") as f:
            json.dump({"kind": kind, "rank": rank, "payload": payload, "extra": extra}, f, default=str)


class _NoProgress:
    def put(self, item) -> None:
        pass


if __name__ == "__main__":
    plan = RankPlan(**json.loads(sys.argv[1]))
    rank_main(int(sys.argv[2]), plan, _FileResult(sys.argv[3]), _NoProgress())
