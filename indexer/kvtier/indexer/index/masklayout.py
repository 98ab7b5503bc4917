"""How the index packs who holds a block where into one int: four bits per worker slot, one per storage tier.

Bit ``TIERS * slot + tier`` of a block's mask is set when the worker in that slot holds the block on that
tier (:class:`kvtier.wire.StorageTier` numbers the tiers: device 0, host 1, disk 2, external 3). Masks are
Python ints, so any number of slots fits; numpy work on them splits them into 64-bit words of
``SLOTS_PER_WORD`` slots each.
"""

from __future__ import annotations

from kvtier.wire.protocol import StorageTier

TIERS = len(StorageTier)  # bits per slot
SLOT_MASK = (1 << TIERS) - 1  # a slot's bits, at slot 0
M64 = (1 << 64) - 1
SLOTS_PER_WORD = 64 // TIERS
DEV = sum(1 << (TIERS * s) for s in range(SLOTS_PER_WORD))  # the device bit of every slot of a 64-bit word
EXT = DEV << StorageTier.EXTERNAL  # the external bit of every slot of a 64-bit word


def slot_shift(slot: int) -> int:
    """Where the slot's bits start. O(1)."""
    return TIERS * slot


def tier_bit(slot: int, tier: int) -> int:
    """The slot's bit for ``tier``. O(1)."""
    return 1 << (TIERS * slot + tier)


def dev_all(slots: int) -> int:
    """The device bit of each of the first ``slots`` slots. O(slots)."""
    return sum(1 << (TIERS * s) for s in range(slots))
