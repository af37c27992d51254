from host.logring import LogRing


def test_ring_is_capped_and_keeps_the_newest_lines():
    ring = LogRing("w-1", capacity=1000)
    for i in range(500):
        ring.append("stderr", f"line {i}\n")
    assert ring.size <= 1000 and ring.dropped_bytes > 0
    tail = ring.tail(100)
    assert tail.endswith("[w-1 stderr] line 499\n") and len(tail) <= 100


def test_a_huge_line_keeps_its_end():
    ring = LogRing("w", capacity=64)
    ring.append("stdout", "x" * 1000 + "THE END")
    assert ring.size <= 64 and ring.tail(32).rstrip().endswith("THE END")
