"""What a booking in flight holds: bytes of memory per prompt block, aggregated and disaggregated.

``POST /route`` books the request on its worker(s) until it finishes or expires, and a booking keeps its prompt's
block keys (the router's load bookkeeping counts the blocks in-flight requests share). The service caps those
blocks (``max_in_flight_blocks``, ``max_in_flight_blocks_per_client``: README, "Security"); this prints what a
block costs, so that a cap can be read in bytes. ``--bookings`` distinct prompts of ``--blocks`` blocks each are
routed and left in flight; the bytes are what Python's allocator (tracemalloc) gained meanwhile.

    python bench/booking_memory.py [--bookings 50] [--blocks 4096]
"""

from __future__ import annotations

import argparse
import random
import tracemalloc

from benchargs import count

from kvtier.indexer.service.app import IndexerService, ServiceConfig, parse_endpoint

BS = 16


def per_block(roles: tuple[str, ...], bookings: int, blocks: int) -> float:
    eps = [parse_endpoint(f"w{i}=tcp://127.0.0.1:{i + 1},role={r}") for i, r in enumerate(roles)]
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", policy="kv_all"))
    rng = random.Random(0)
    prompt = [rng.randrange(1 << 20) for _ in range(blocks * BS)]
    svc.route({"token_ids": prompt, "request_id": "warm-up"})  # (the first route builds what every one reuses)
    svc.finish("warm-up")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(bookings):
        prompt[0] = (1 << 20) + i  # a prompt of its own: no block shared with another booking
        svc.route({"token_ids": prompt, "request_id": f"r{i}"})
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert svc.clients.blocks == bookings * blocks
    return grown / (bookings * blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bookings", type=count(), default=50)
    ap.add_argument("--blocks", type=count(), default=4096, help="blocks per prompt")
    a = ap.parse_args()
    print(f"{a.bookings} bookings in flight of {a.blocks} blocks of {BS} tokens, distinct prompts")
    for name, roles in (("aggregated (2 workers)", ("both", "both")),
                        ("disaggregated (1P+1D)", ("prefill", "decode"))):
        print(f"  {name:24} {per_block(roles, a.bookings, a.blocks):6.1f} bytes per booked block")
    print("target: none set; the figure turns the caps on booked blocks into bytes. No peer books prompts this way")


if __name__ == "__main__":
    main()
