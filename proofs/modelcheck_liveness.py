"""Liveness on the explored graph (``proofs/modelcheck.py``, "Properties": (a) every
request that is not aborted finishes, (b) no stuck work), decided by backward
reachability over the ``Step``/``AdvanceClock`` edges.
"""

from __future__ import annotations

from array import array

from vllm_output_rate.proofs.modelcheck_results import ScopeResult, Violation


def _backward_closure(n: int, seeds: bytearray, edge_src: array, edge_dst: array) -> bytearray:
    """States from which some seed state is reachable along the edges."""
    # Reverse adjacency in CSR form.
    count = array("i", bytes(4 * (n + 1)))
    for dst in edge_dst:
        count[dst + 1] += 1
    for i in range(n):
        count[i + 1] += count[i]
    fill = array("i", count)
    rev = array("i", bytes(4 * len(edge_dst)))
    for src, dst in zip(edge_src, edge_dst):
        rev[fill[dst]] = src
        fill[dst] += 1
    good = bytearray(seeds)
    stack = [i for i in range(n) if good[i]]
    while stack:
        node = stack.pop()
        for k in range(count[node], count[node + 1]):
            src = rev[k]
            if not good[src]:
                good[src] = 1
                stack.append(src)
    return good


def _check_liveness(result: ScopeResult, keys, no_work, crashed, productive, edge_src, edge_dst, depth) -> None:
    n = len(keys)
    seeds_a = bytearray(1 if (no_work[i] or crashed[i]) else 0 for i in range(n))
    can_finish = _backward_closure(n, seeds_a, edge_src, edge_dst)
    seeds_b = bytearray(1 if (productive[i] or crashed[i] or no_work[i]) else 0 for i in range(n))
    can_progress = _backward_closure(n, seeds_b, edge_src, edge_dst)
    stuck = next((i for i in range(n) if not can_progress[i]), None)  # ids grow with depth: the shallowest
    if stuck is not None:
        result.violations["liveness-b"] = Violation(
            "liveness-b",
            "liveness (b): work is left and no sequence of steps and clock advances ever schedules "
            "a token again (engine healthy but stuck)",
            depth[stuck],
            stuck,
        )
    unfinished = next((i for i in range(n) if not can_finish[i]), None)
    if unfinished is not None:
        result.violations["liveness-a"] = Violation(
            "liveness-a",
            "liveness (a): from this state no sequence of steps and clock advances finishes every live request",
            depth[unfinished],
            unfinished,
        )
