"""adapter/z3guard.py: Z3 work of the gate runs with cyclic GC held off and in one thread."""

from __future__ import annotations

import gc
import threading

from vllm_output_rate.adapter.z3guard import z3_alone


def test_no_cyclic_collection_inside_and_garbage_collected_on_the_way_out():
    class Node:
        pass

    collected: list[int] = []
    gc.callbacks.append(lambda phase, info: collected.append(1) if phase == "stop" else None)
    try:
        with z3_alone():
            assert not gc.isenabled()
            for _ in range(20_000):  # cyclic garbage that would trigger a collection
                a, b = Node(), Node()
                a.other, b.other = b, a
            assert collected == []
        assert gc.isenabled() and collected  # collected on the way out
    finally:
        gc.callbacks.pop()


def test_one_thread_at_a_time():
    inside: list[str] = []

    def other():
        with z3_alone():
            inside.append("other")

    with z3_alone():
        worker = threading.Thread(target=other)
        worker.start()
        worker.join(0.2)
        assert inside == [] and worker.is_alive()  # waits for the block to end
    worker.join(5)
    assert inside == ["other"]


def test_the_bodys_cyclic_garbage_is_freed_by_a_young_generation_collection():
    # A full collection walks the whole heap (0.35 s a call with vLLM loaded, which made a
    # profile-quick boundary check 12 s instead of 1 s); everything the body allocated is
    # still young, so generations 0 and 1 suffice, and the body's cycles are freed.
    import weakref

    class Node:
        pass

    generations: list[int] = []
    gc.callbacks.append(lambda phase, info: generations.append(info["generation"]) if phase == "start" else None)
    try:
        with z3_alone():
            a, b = Node(), Node()
            a.other, b.other = b, a
            dead = weakref.ref(a)
            del a, b
            assert dead() is not None  # no collection inside
        assert dead() is None and generations == [1]
    finally:
        gc.callbacks.pop()
