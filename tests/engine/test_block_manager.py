"""Block manager invariants under randomized operation sequences (no MLX)."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from mlxq.worker.engine.block_manager import BlockManager

from enginekit import chain_hashes, evict_cached

BS = 4  # small blocks keep the random sequences short


def _owners_refcounts(owners, n):
    counts = [0] * n
    for table in owners.values():
        for b in table:
            counts[b] += 1
    return counts


def _check(bm: BlockManager, owners: dict):
    bm.check_invariants()
    expected = _owners_refcounts(owners, bm.num_blocks)
    assert [b.ref_count for b in bm.blocks] == expected
    # no block both free (allocatable) and used
    lru = set(bm._lru)
    used = {b for t in owners.values() for b in t}
    assert not (lru & used)
    assert len(lru) + len(used) == bm.num_blocks
    c = bm.counts()
    assert c.used + c.cached + c.free == c.total
    assert c.used == len(used)
    # every indexed hash belongs to a block holding exactly those tokens
    for h, bid in bm._by_hash.items():
        assert bm.blocks[bid].hash == h
        assert len(bm.blocks[bid].tokens) == BS


op = st.tuples(st.sampled_from(["alloc", "append", "free", "evict", "pin"]),
               st.integers(0, 10**6))


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=1, max_size=60), st.integers(4, 24))
def test_random_operations_keep_invariants(ops, num_blocks):
    bm = BlockManager(num_blocks, block_size=BS, model_id="m")
    owners: dict[int, list[int]] = {}
    seq_tokens: dict[int, list[int]] = {}
    next_id = 0
    for name, r in ops:
        rng = random.Random(r)
        if name == "alloc":
            # prompts drawn from a small alphabet so prefixes repeat
            prefix = [1, 2, 3, 4, 5, 6, 7, 8][: rng.randrange(0, 9)]
            tokens = prefix + [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
            hit = bm.lookup(tokens, len(tokens) - 1)
            assert hit.num_blocks * BS <= len(tokens) - 1
            for i, bid in enumerate(hit.block_ids):
                assert bm.blocks[bid].tokens == tuple(tokens[i * BS:(i + 1) * BS])
            assert hit.hashes == chain_hashes(tokens, "m", BS)[: hit.num_blocks]
            need = bm.blocks_needed(len(tokens)) - hit.num_blocks
            if bm.can_allocate(need, hit):
                table = bm.allocate(need, hit)
                assert len(set(table)) == len(table)
                # commit the full blocks as the engine does after computing them
                parent = hit.hashes[-1] if hit.hashes else None
                for i in range(hit.num_blocks, len(tokens) // BS):
                    parent = bm.commit(table[i], parent, tokens[i * BS:(i + 1) * BS])
                owners[next_id] = table
                seq_tokens[next_id] = tokens
                next_id += 1
            else:
                with pytest.raises(MemoryError):
                    bm.allocate(need, hit)
        elif name == "append" and owners:
            sid = rng.choice(list(owners))
            if bm.can_append():
                owners[sid].append(bm.append_block())
        elif name == "free" and owners:
            sid = rng.choice(list(owners))
            bm.deallocate(owners.pop(sid))
        elif name == "evict":
            before = bm.counts().cached
            n = evict_cached(bm, rng.randrange(3))
            assert bm.counts().cached == before - n
        elif name == "pin" and owners:
            sid = rng.choice(list(owners))
            bm.ref(owners[sid])
            owners[next_id] = list(owners[sid])
            next_id += 1
        _check(bm, owners)
    for sid in list(owners):
        bm.deallocate(owners.pop(sid))
    _check(bm, owners)
    assert bm.counts().used == 0


def test_prefix_hit_shares_blocks_and_caps_at_len_minus_one():
    bm = BlockManager(16, block_size=BS)
    a = list(range(12))  # 3 full blocks
    t1 = bm.allocate(3)
    p = None
    for i in range(3):
        p = bm.commit(t1[i], p, a[i * BS:(i + 1) * BS])
    hit = bm.lookup(a, len(a) - 1)  # capped: only 2 blocks may hit
    assert hit.block_ids == t1[:2]
    t2 = bm.allocate(1, hit)
    assert t2[:2] == t1[:2]
    assert bm.blocks[t1[0]].ref_count == 2
    # a token mismatch after the first block stops the chain
    assert bm.lookup(a[:4] + [99] * 8, 11).block_ids == t1[:1]


def test_freed_blocks_keep_hash_and_tail_is_reused_first():
    bm = BlockManager(4, block_size=BS)
    toks = list(range(8))
    t = bm.allocate(2)
    bm.commit(t[1], bm.commit(t[0], None, toks[:4]), toks[4:])
    bm.deallocate(t)
    assert bm.counts().cached == 2
    assert bm.lookup(toks + [0], 8).block_ids == t  # still hits after free
    bm.allocate(2)  # the two never-used blocks first
    (b,) = bm.allocate(1)
    assert b == t[1]  # then the tail of the freed sequence
    assert bm.evictions == 1
    assert bm.lookup(toks + [0], 8).block_ids == [t[0]]


def test_deallocate_unreferenced_raises():
    bm = BlockManager(2, block_size=BS)
    (b,) = bm.allocate(1)
    bm.deallocate([b])
    with pytest.raises(ValueError):
        bm.deallocate([b])


def test_commit_full_extends_the_chain_over_full_known_blocks_only():
    bm = BlockManager(8, block_size=BS, model_id="m")
    toks = list(range(1, 12))  # 2 full blocks + 3 tokens
    table = bm.allocate(3)
    hashes = [bm.commit(table[0], None, toks[:BS])]  # the first block committed already
    bm.commit_full(table, hashes, toks, 7)  # 7 tokens known: still one full block
    assert len(hashes) == 1
    bm.commit_full(table, hashes, toks, len(toks))
    assert hashes == chain_hashes(toks, "m", BS)
    assert bm.lookup(toks, len(toks)).block_ids == table[:2]
